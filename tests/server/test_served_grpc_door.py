"""Triton's public gRPC port of ``serve all`` goes through the public door (issue 27
re-review F5, :mod:`triton_disagg.front.public_door`): Triton 2.51 takes a message of up to
2 GiB and holds it several times over while a model refuses it, so tritonserver listens on
loopback and the door, on the public port, refuses a message over the front's body bound
before it is read. Measured: tritonserver's peak resident memory (``VmHWM``) around a
refused ``SIZE`` message, at the door (it must not move) and at tritonserver's own port (it
grows by more than ``SIZE``: what the door spares it). Through the door everything else
works as before: streamed tokens, a client's cancel, health; the restricted APIs stay
closed; a context server's ports are behind doors too. The HTTP and metrics doors:
test_served_http_doors.py."""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import servers
from door_probes import SIZE, UNMOVED_BYTES, flag, forms_refused_at_the_metrics_door, peak_rss
from front_server import blocks_used
from triton_disagg.front.openai_api import MAX_BODY_BYTES
from triton_disagg.triton.tritonserver import RESTRICTED_HEADER

REFUSED_WITHIN_SECONDS = 5.0


def _inner_grpc(served) -> str:
    return f"{flag(served, 'grpc-address')}:{flag(served, 'grpc-port')}"


def _infer_large(grpc: str) -> tuple[object, float]:
    """Send a ``SIZE`` text to preprocessing (the ensemble's first step; the ensemble itself
    takes streams alone) over gRPC: (the error, seconds until it came)."""
    import tritonclient.grpc as grpcclient

    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"a" * SIZE]], dtype=object))
    max_tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    max_tokens.set_data_from_numpy(np.array([[4]], np.int32))
    with grpcclient.InferenceServerClient(grpc) as client:
        start = time.monotonic()
        with pytest.raises(grpcclient.InferenceServerException) as refused:
            client.infer("preprocessing", [text, max_tokens])
        return refused.value, time.monotonic() - start


def test_a_large_grpc_message_is_refused_at_the_door_before_tritonserver(server):
    assert flag(server, "grpc-address") == "127.0.0.1"
    assert flag(server, "grpc-port") != server.grpc.rsplit(":", 1)[1]
    before = peak_rss(server)
    error, seconds = _infer_large(server.grpc)
    assert error.status() == "StatusCode.RESOURCE_EXHAUSTED", error
    assert str(MAX_BODY_BYTES) in error.message(), error.message()
    assert seconds < REFUSED_WITHIN_SECONDS
    with pytest.raises(RuntimeError, match=f"larger than max .* vs. {MAX_BODY_BYTES}"):
        servers.grpc_stream(server.grpc, "a" * SIZE, 4)       # the ensemble's stream too
    assert peak_rss(server) - before < UNMOVED_BYTES
    error, _ = _infer_large(_inner_grpc(server))         # what the door spares tritonserver
    assert "more than the" in error.message(), error.message()
    assert peak_rss(server) - before > SIZE


def test_streamed_tokens_through_the_door_are_tritonservers_own(server):
    through_door = servers.grpc_stream(server.grpc, "The quick brown fox", 12)
    assert len(through_door) > 1, through_door          # streamed, not one piece
    text = "".join(through_door)         # (deltas of tokens that came together are one)
    assert text == "".join(servers.grpc_stream(_inner_grpc(server), "The quick brown fox", 12))
    events = servers.generate_stream(server.http, {"text_input": "The quick brown fox",
                                                   "max_tokens": 12})
    assert "".join(e["text_output"] for e in events) == text


def test_a_cancel_through_the_door_ends_the_request_and_frees_its_blocks(server):
    servers.cancel_a_stream(server.grpc, server.metrics)
    servers.wait_until(lambda: blocks_used(server) == 0, 30, "the KV blocks freed")


def _busy_stream_with_unknown_models(grpc: str, unknown: int) -> tuple[int, int]:
    """On one tritonclient stream: a request streaming tokens, then, while it streams,
    ``unknown`` requests to a 3 MB model name. Returns (error answers, whether the streamed
    request reached its final response)."""
    import queue

    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    inputs = servers.array_inputs({"text_input": np.array([[b"The quick brown fox"]], dtype=object),
                                   "max_tokens": np.array([[96]], dtype=np.int32),
                                   "stream": np.array([[True]], dtype=bool)})
    errors, final = 0, False
    with grpcclient.InferenceServerClient(grpc) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("ensemble", inputs, request_id="long",
                                  enable_empty_final_response=True)
        answers.get(timeout=60)                             # streaming now
        for i in range(unknown):
            client.async_stream_infer("m" * 3_000_000, inputs, request_id=f"unknown{i}")
        while not final or errors < unknown:
            try:
                result, error = answers.get(timeout=20)
            except queue.Empty:
                break
            errors += error is not None
            final = final or (error is None and result.get_response()
                              .parameters["triton_final_response"].bool_param)
        client.stop_stream()
    return errors, final


def test_an_error_answer_on_a_busy_stream_leaves_tritonserver_serving(server):
    """rev27g: Triton 2.51 aborts (``proto_buffer_writer.h:65``) writing an error answer on
    a stream that is streaming another request's tokens (shown with unknown model names of
    a few MB: one error came back, then tritonserver was gone). The door gives each
    message of a client's stream its own inner stream, so Triton never writes two requests'
    answers on one. Here a door without its model screen (which refuses such names before
    Triton sees them) stands in front of the served tritonserver."""
    import asyncio
    import threading

    from triton_disagg.front.public_door import GrpcDoor

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def opened() -> GrpcDoor:        # grpc.aio binds a server to the loop it is made on
        door = GrpcDoor("127.0.0.1", servers.free_ports(1)[0], _inner_grpc(server), 8 << 20,
                        None)
        await door.start()
        return door
    door = asyncio.run_coroutine_threadsafe(opened(), loop).result(10)
    pid = servers.tritonserver_pid(server.work_dir)
    try:
        errors, final = _busy_stream_with_unknown_models(door.address, 8)
    finally:
        asyncio.run_coroutine_threadsafe(door.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
    assert (errors, final) == (8, True)
    assert servers.tritonserver_pid(server.work_dir) == pid and Path(f"/proc/{pid}").exists()
    assert "".join(servers.grpc_stream(server.grpc, "The quick brown fox", 4))


def test_health_passes_the_door_and_the_restricted_apis_stay_closed(server):
    """Health answers through the door; the restricted APIs answer no header a client can
    send (its name holds a ':'), and Triton's refusal comes back through the door as is."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    with urllib.request.urlopen(server.http + "/v2/health/ready", timeout=10) as resp:
        assert resp.status == 200
    value = flag(server, "http-restricted-api").rsplit("=", 1)[1]
    head, _, tail = RESTRICTED_HEADER.partition(":")
    logging = urllib.request.Request(server.http + "/v2/logging", headers={head: f"{tail}={value}"})
    with pytest.raises(urllib.error.HTTPError, match="403") as refused:
        urllib.request.urlopen(logging, timeout=10)
    assert RESTRICTED_HEADER in refused.value.read().decode()
    with grpcclient.InferenceServerClient(server.grpc) as client:
        assert client.is_server_ready()
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_log_settings(headers={f"triton-grpc-protocol-{head}": f"{tail}={value}"})


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to listen as another user")
def test_a_port_another_user_listens_on_is_not_the_doors_to_forward_to(tmp_path):
    """rev27c: the inner ports are on tritonserver's command line, and a local user who
    binds one first would have received what the door forwards. The door forwards only to
    ports whose every listener is this user's."""
    import socket
    import subprocess
    import sys

    from triton_disagg.front.door_guards import InnerOwner

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    squatter = subprocess.Popen(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         f"import socket, time; s = socket.socket(); s.bind(('0.0.0.0', {port})); s.listen();"
         f" print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "up"
        assert not InnerOwner((port,)).check()
    finally:
        squatter.kill()
        squatter.wait()


def test_a_context_servers_ports_are_behind_the_doors_too(demo_engine, tmp_path):
    """rev27f M1: Triton read a whole message (50 MB: 1.5 GB of tritonserver) on a context's
    or generation's port before the model checked the peer credential; their gRPC port is
    the door's now (no call cap: their callers cap their own), and their metrics too."""
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\nkv_cache: {{max_size: 16MB}}\n")
    with servers.serve("context", ["-c", str(config)], tmp_path / "c", http=False) as context:
        assert flag(context, "grpc-address") == "127.0.0.1"
        assert flag(context, "grpc-port") != context.grpc.rsplit(":", 1)[1]
        before = peak_rss(context)
        error, seconds = _infer_large(context.grpc)
        assert error.status() == "StatusCode.RESOURCE_EXHAUSTED", error
        assert seconds < REFUSED_WITHIN_SECONDS
        assert peak_rss(context) - before < UNMOVED_BYTES
        forms_refused_at_the_metrics_door(context)


def test_a_message_of_millions_of_strings_is_refused_at_the_door(server):
    """rev27f H2: a 10 MiB ``stop_words`` of 3 million empty strings took tritonserver
    ~200 MB per queued message (its protobuf's objects); the door refuses it unread by
    tritonserver, whose peak memory does not move."""
    import grpc
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="ensemble")
    words = request.inputs.add(name="stop_words", datatype="BYTES", shape=[1, 3_000_000])
    words.contents.bytes_contents.extend([b""] * 3_000_000)
    before = peak_rss(server)
    with grpc.insecure_channel(server.grpc) as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                       response_deserializer=service_pb2.
                                       ModelStreamInferResponse.FromString)
        answers = list(stream(iter([request.SerializeToString()] * 4), timeout=60))
    assert len(answers) == 4 and all("at most" in a.error_message for a in answers), answers
    assert peak_rss(server) - before < UNMOVED_BYTES

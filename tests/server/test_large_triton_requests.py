"""Triton's public ports of ``serve all`` go through the public door (issue 27 re-review F5,
:mod:`triton_disagg.front.public_door`): Triton 2.51 takes a message of up to 2 GiB and
holds it several times over while a model refuses it, so tritonserver listens on loopback
and the door, on the public ports, refuses a message over the front's body bound before
it is read. Measured: tritonserver's peak resident memory (``VmHWM``) around a refused
``SIZE`` message, at the door (it must not move) and at tritonserver's own port (it grows
by more than ``SIZE``: what the door spares it). Through the door everything else works as
before: streamed tokens, a client's cancel, health; the restricted APIs stay closed. The
metrics port of every role is the metrics door's (GET alone), and a form POST that killed
Triton 2.51's metrics server no longer reaches it."""

from __future__ import annotations

import gzip
import http.client
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import servers
from front_server import blocks_used
from triton_disagg.front.openai_api import MAX_BODY_BYTES
from triton_disagg.triton.tritonserver import RESTRICTED_HEADER

SIZE = 64 * 2**20
REFUSED_WITHIN_SECONDS = 5.0
UNMOVED_BYTES = 16 * 2**20      # tritonserver's peak may move this much for other reasons


@pytest.fixture(scope="module")
def served(demo_engine, tmp_path_factory):
    with servers.serve_config(f"model: {{engine: {demo_engine}}}\nkv_cache: {{max_size: 16MB}}\n",
                              tmp_path_factory.mktemp("door")) as served:
        yield served


def _flag(served, name: str) -> str:
    return servers.tritonserver_flag(served.work_dir, name)


def _inner_grpc(served) -> str:
    return f"{_flag(served, 'grpc-address')}:{_flag(served, 'grpc-port')}"


def _peak_rss(served) -> int:
    """tritonserver's peak resident bytes so far."""
    status = Path(f"/proc/{servers.tritonserver_pid(served.work_dir)}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


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


def test_a_large_grpc_message_is_refused_at_the_door_before_tritonserver(served):
    assert _flag(served, "grpc-address") == "127.0.0.1"
    assert _flag(served, "grpc-port") != served.grpc.rsplit(":", 1)[1]
    before = _peak_rss(served)
    error, seconds = _infer_large(served.grpc)
    assert error.status() == "StatusCode.RESOURCE_EXHAUSTED", error
    assert str(MAX_BODY_BYTES) in error.message(), error.message()
    assert seconds < REFUSED_WITHIN_SECONDS
    with pytest.raises(RuntimeError, match=f"larger than max .* vs. {MAX_BODY_BYTES}"):
        servers.grpc_stream(served.grpc, "a" * SIZE, 4)       # the ensemble's stream too
    assert _peak_rss(served) - before < UNMOVED_BYTES
    error, _ = _infer_large(_inner_grpc(served))         # what the door spares tritonserver
    assert "more than the" in error.message(), error.message()
    assert _peak_rss(served) - before > SIZE


def test_a_large_http_body_is_refused_at_the_door_before_it_is_sent(served):
    host, port = served.http.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:                # the headers alone: the door answers without waiting for the body
        conn.putrequest("POST", "/v2/models/ensemble/generate")
        conn.putheader("Content-Length", str(SIZE))
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 413, response.read()
        assert str(MAX_BODY_BYTES) in response.read().decode()
    finally:
        conn.close()


def test_a_chunked_or_compressed_body_is_refused_at_the_door(served):
    def chunks():
        for _ in range(MAX_BODY_BYTES // 2**20 + 2):
            yield b"a" * 2**20

    chunked = urllib.request.Request(served.http + "/v2/models/ensemble/generate",
                                     data=chunks(), headers={"Transfer-Encoding": "chunked"})
    with pytest.raises(urllib.error.HTTPError, match="413"):
        urllib.request.urlopen(chunked, timeout=30)
    gzipped = urllib.request.Request(served.http + "/v2/models/ensemble/generate",
                                     data=gzip.compress(b"{}"),
                                     headers={"Content-Encoding": "gzip"})
    with pytest.raises(urllib.error.HTTPError, match="415"):
        urllib.request.urlopen(gzipped, timeout=30)


def test_streamed_tokens_through_the_door_are_tritonservers_own(served):
    through_door = servers.grpc_stream(served.grpc, "The quick brown fox", 12)
    assert len(through_door) > 1, through_door          # streamed, not one piece
    text = "".join(through_door)         # (deltas of tokens that came together are one)
    assert text == "".join(servers.grpc_stream(_inner_grpc(served), "The quick brown fox", 12))
    events = servers.generate_stream(served.http, {"text_input": "The quick brown fox",
                                                   "max_tokens": 12})
    assert "".join(e["text_output"] for e in events) == text


def test_a_cancel_through_the_door_ends_the_request_and_frees_its_blocks(served):
    servers.cancel_a_stream(served.grpc, served.metrics)
    servers.wait_until(lambda: blocks_used(served) == 0, 30, "the KV blocks freed")


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


def test_an_error_answer_on_a_busy_stream_leaves_tritonserver_serving(served):
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
        door = GrpcDoor("127.0.0.1", servers.free_ports(1)[0], _inner_grpc(served), 8 << 20,
                        None)
        await door.start()
        return door
    door = asyncio.run_coroutine_threadsafe(opened(), loop).result(10)
    pid = servers.tritonserver_pid(served.work_dir)
    try:
        errors, final = _busy_stream_with_unknown_models(door.address, 8)
    finally:
        asyncio.run_coroutine_threadsafe(door.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
    assert (errors, final) == (8, True)
    assert servers.tritonserver_pid(served.work_dir) == pid and Path(f"/proc/{pid}").exists()
    assert "".join(servers.grpc_stream(served.grpc, "The quick brown fox", 4))


def test_health_passes_the_door_and_the_restricted_apis_stay_closed(served):
    """Health answers through the door; the restricted APIs answer no header a client can
    send (its name holds a ':'), and Triton's refusal comes back through the door as is."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    with urllib.request.urlopen(served.http + "/v2/health/ready", timeout=10) as resp:
        assert resp.status == 200
    value = _flag(served, "http-restricted-api").rsplit("=", 1)[1]
    head, _, tail = RESTRICTED_HEADER.partition(":")
    logging = urllib.request.Request(served.http + "/v2/logging", headers={head: f"{tail}={value}"})
    with pytest.raises(urllib.error.HTTPError, match="403") as refused:
        urllib.request.urlopen(logging, timeout=10)
    assert RESTRICTED_HEADER in refused.value.read().decode()
    with grpcclient.InferenceServerClient(served.grpc) as client:
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
        assert not InnerOwner((port,)).ours()
    finally:
        squatter.kill()
        squatter.wait()


METRICS_POST_BYTES = 16 * 10**6     # Triton 2.51's metrics server died on a form this large


def _post_metrics(metrics: str, body: bytes) -> int | None:
    """POST ``body`` as a form (curl's ``--data-binary`` default) to ``metrics``'s
    ``/metrics``: the status, or None when the server closed the connection instead."""
    host, port = metrics.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/metrics", body=body,
                     headers={"Content-Type": "application/x-www-form-urlencoded"})
        response = conn.getresponse()
        response.read()
        return response.status
    except (ConnectionError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def _forms_refused_at_the_metrics_door(served) -> None:
    """Large form POSTs to ``served``'s metrics port are refused and its tritonserver, whose
    metrics listen on loopback behind the door, lives on and still answers a scrape."""
    assert _flag(served, "metrics-address") == "127.0.0.1"
    assert _flag(served, "metrics-port") != served.metrics.rsplit(":", 1)[1]
    pid = servers.tritonserver_pid(served.work_dir)
    for _ in range(3):
        assert _post_metrics(served.metrics, bytes(METRICS_POST_BYTES)) in (405, 413, None)
    assert _post_metrics(served.metrics, b"a" * 10) == 405
    time.sleep(1)                       # a crash takes the process down within this
    assert servers.tritonserver_pid(served.work_dir) == pid
    text = servers.metrics(served.metrics)
    assert "nv_inference_request_success" in text and "disagg_kv_blocks_used" in text


def test_a_large_post_to_metrics_is_refused_at_the_door_and_tritonserver_lives(served):
    """rev27e: tritonserver 2.51's metrics server segfaulted on a ~16 MB form POST to
    /metrics (failed before the metrics door: the second POST found nobody listening), a
    port Prometheus scrapes on every role. The door answers a bodiless GET alone."""
    _forms_refused_at_the_metrics_door(served)


def test_a_context_servers_ports_are_behind_the_doors_too(demo_engine, tmp_path):
    """rev27f M1: Triton read a whole message (50 MB: 1.5 GB of tritonserver) on a context's
    or generation's port before the model checked the peer credential; their gRPC port is
    the door's now (no call cap: their callers cap their own), and their metrics too."""
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\nkv_cache: {{max_size: 16MB}}\n")
    with servers.serve("context", ["-c", str(config)], tmp_path / "c", http=False) as context:
        assert _flag(context, "grpc-address") == "127.0.0.1"
        assert _flag(context, "grpc-port") != context.grpc.rsplit(":", 1)[1]
        before = _peak_rss(context)
        error, seconds = _infer_large(context.grpc)
        assert error.status() == "StatusCode.RESOURCE_EXHAUSTED", error
        assert seconds < REFUSED_WITHIN_SECONDS
        assert _peak_rss(context) - before < UNMOVED_BYTES
        _forms_refused_at_the_metrics_door(context)


def _post_form(url: str, path: str, body: bytes) -> tuple[int | None, bytes]:
    """POST ``body`` to ``url`` + ``path`` as curl's ``-d`` sends it: (status or None when
    the connection closed instead, the answer)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=body,
                     headers={"Content-Type": "application/x-www-form-urlencoded"})
        response = conn.getresponse()
        return response.status, response.read()
    except (ConnectionError, http.client.HTTPException):
        return None, b""
    finally:
        conn.close()


def test_a_large_form_post_through_the_http_door_leaves_tritonserver_serving(served):
    """rev27f H1: Triton 2.51's HTTP server died (SIGSEGV) on an ~8 MB form body on any
    path, under the door's 10 MiB bound; the door forwards no form Content-Type, so the
    body is Triton's JSON, refused as such, and a JSON body sent as curl's ``-d`` works."""
    pid = servers.tritonserver_pid(served.work_dir)
    big = b"a" * (MAX_BODY_BYTES - 2**16)
    status, answer = _post_form(served.http, "/v2/models/ensemble/generate", big)
    # measured: Triton 2.51 answers a body that is not JSON with 500
    assert status in (400, 500) and b"failed to parse the request JSON" in answer, answer
    status, answer = _post_form(served.http, "/v2/health/ready", big)
    assert status is not None and 400 <= status < 500, (status, answer)
    time.sleep(1)
    assert servers.tritonserver_pid(served.work_dir) == pid
    status, answer = _post_form(served.http, "/v2/models/ensemble/generate",
                                b'{"text_input": "The quick brown fox", "max_tokens": 4}')
    assert status == 200, answer


def test_a_message_of_millions_of_strings_is_refused_at_the_door(served):
    """rev27f H2: a 10 MiB ``stop_words`` of 3 million empty strings took tritonserver
    ~200 MB per queued message (its protobuf's objects); the door refuses it unread by
    tritonserver, whose peak memory does not move."""
    import grpc
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="ensemble")
    words = request.inputs.add(name="stop_words", datatype="BYTES", shape=[1, 3_000_000])
    words.contents.bytes_contents.extend([b""] * 3_000_000)
    before = _peak_rss(served)
    with grpc.insecure_channel(served.grpc) as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                       response_deserializer=service_pb2.
                                       ModelStreamInferResponse.FromString)
        answers = list(stream(iter([request.SerializeToString()] * 4), timeout=60))
    assert len(answers) == 4 and all("at most" in a.error_message for a in answers), answers
    assert _peak_rss(served) - before < UNMOVED_BYTES


HTTP_EMPTY_STRINGS = 3_000_000      # '"",' each: a 9 MB body, under the door's 10 MiB
HTTP_NUMBERS = 4 * 2**20            # '0,' each: an 8 MB body (the gRPC door's MAX_NUMBERS)


def _infer_json(name: str, datatype: str, values: bytes, count: int) -> bytes:
    """preprocessing's infer body: a text, max_tokens and ``name``, ``count`` ``values``."""
    return (b'{"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], '
            b'"data": ["a"]}, {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], '
            b'"data": [4]}, {"name": "' + name.encode() + b'", "datatype": "'
            + datatype.encode() + b'", "shape": [1, ' + str(count).encode() + b'], "data": ['
            + b",".join([values] * count) + b"]}]}")


def _post_json(served, path: str, body: bytes) -> tuple[int, bytes]:
    """POST ``body`` as JSON to ``served``'s HTTP port: (status, answer)."""
    host, port = served.http.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_an_http_body_of_millions_of_strings_or_numbers_is_refused_at_the_door(served):
    """Issue 27 (HTTP door): Triton's JSON parser holds each value as an object: a 9 MB
    infer body whose ``data`` is 3 million empty strings took tritonserver +100 MB (and the
    stub +52 MB), one of 4M numbers +136 MB. The door counts the JSON's strings and values
    from its bytes and refuses both unread by tritonserver, whose peak memory does not move
    (reset first: an earlier test's peak would hide a jump); and, as the gRPC door, an
    inference request naming a model not served."""
    from triton_disagg.front.door_guards import MAX_ENTRIES

    pid = servers.tritonserver_pid(served.work_dir)
    for body in (_infer_json("stop_words", "BYTES", b'""', HTTP_EMPTY_STRINGS),
                 _infer_json("input_ids", "INT32", b"0", HTTP_NUMBERS)):
        assert len(body) < MAX_BODY_BYTES
        Path(f"/proc/{pid}/clear_refs").write_text("5")     # VmHWM := VmRSS
        before = _peak_rss(served)
        status, answer = _post_json(served, "/v2/models/preprocessing/infer", body)
        assert status == 400 and f"at most {MAX_ENTRIES}".encode() in answer, (status, answer)
        assert _peak_rss(served) - before < UNMOVED_BYTES
    status, answer = _post_json(served, "/v2/models/nosuchmodel/generate", b"{}")
    assert status == 400 and b"'nosuchmodel' is not served here" in answer, answer

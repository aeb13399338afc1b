"""Disaggregated serving on the demo engine: context -> KV handoff -> generation.

`serve all` with each KV strategy on each model runtime (numpy; torch on CPU), and the
three roles as separate servers
(the scheduler dials context and generation over gRPC). Greedy output equals
the offline engine; cancelled, expired and refused handoffs leave the pools at
zero blocks used; a replayed, tampered or garbage handle is that request's error.
Every server here gets one TRITON_DISAGG_KV_SECRET, so the tests can sign handles and call
context and generation as the deployment's orchestrators do (with its peer credential).
"""

from __future__ import annotations

import dataclasses
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import servers
from servers import PROMPTS

LEASE_SECONDS = 5
SECRET = "test-deployment-secret-" + "5" * 32


@pytest.fixture(scope="module", autouse=True)
def shared_secret():
    """The deployment secret, in the environment every `serve` of this module inherits."""
    from triton_disagg.kv.secret import SECRET_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SECRET_ENV, SECRET)
        yield


@pytest.fixture(scope="module")
def offline(demo_engine):
    return servers.offline_text(demo_engine)


def _config(path, engine, strategy, extra="", runtime="numpy"):
    """16 MB: a max_seq_len sequence of the demo engine takes 8 MiB, these tests' busiest
    moment about 6, and a host_memory staging area this size fits Docker's default 64 MB
    /dev/shm beside Triton's own regions."""
    path.write_text(f"model: {{engine: {engine}, runtime: {runtime}, device: cpu}}\n"
                    f"kv_cache: {{strategy: {strategy}, max_size: 16MB, "
                    f"lease_seconds: {LEASE_SECONDS}}}\n{extra}")
    return path


@pytest.fixture(scope="module", params=[
    ("direct_transfer", "numpy"), ("host_memory", "numpy"),
    ("direct_transfer", "torch"), ("host_memory", "torch"),
    ("direct_transfer", "numpy", "overlap")], ids="-".join)
def server(request, demo_engine, tmp_path_factory):
    """``overlap``: ``--overlap_kv_transfer`` (generation reads the KV during the prefill)."""
    strategy, runtime, *overlap = request.param
    work = tmp_path_factory.mktemp(f"serve-{strategy}-{runtime}")
    config = _config(work / "disagg_config.yaml", demo_engine, strategy, runtime=runtime)
    flags = ["--overlap_kv_transfer", "--log-format", "json"] if overlap else []   # json: INFO
    with servers.serve("all", ["-c", str(config)] + flags, work / "run") as served:
        yield served


def _gauges(served, name):
    return {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
            for line in servers.metrics(served.metrics).splitlines() if line.startswith(name + "{")}


def _wait_pools_empty(served, timeout=3 * LEASE_SECONDS + 5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        used = _gauges(served, "disagg_kv_blocks_used")
        if len(used) == 2 and not any(used.values()):
            return
        time.sleep(0.25)
    raise AssertionError(f"pools not empty: {used}")


def test_greedy_equals_offline_over_every_client(server, offline):
    for prompt in PROMPTS:
        status, body = servers.generate(server.http, {"text_input": prompt, "max_tokens": 20})
        assert status == 200 and body["text_output"] == offline(prompt, 20), body
        events = servers.generate_stream(server.http, {"text_input": prompt, "max_tokens": 20,
                                                       "stream": True})
        assert "".join(e["text_output"] for e in events) == offline(prompt, 20)
    assert "".join(servers.grpc_stream(server.grpc, PROMPTS[1], 20)) == offline(PROMPTS[1], 20)
    if "--overlap_kv_transfer" in server.process.args:      # its context says so per request
        assert "handed off (overlapped)" in server.server_log()


def test_concurrent_and_first_token_only(server, offline):
    jobs = [(p, n) for p in PROMPTS for n in (1, 7, 19)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: servers.generate(
            server.http, {"text_input": j[0], "max_tokens": j[1]}), jobs))
    for (prompt, n), (status, body) in zip(jobs, results):
        assert status == 200 and body["text_output"] == offline(prompt, n), (prompt, n, body)
    _wait_pools_empty(server)
    m = servers.metrics(server.metrics)
    assert "disagg_kv_transfer_bytes_total{" in m and "disagg_time_to_first_token_seconds_count" in m


def test_32_concurrent_streams_each_get_their_text(server, offline):
    jobs = [(PROMPTS[i % len(PROMPTS)], 8 + i % 13) for i in range(32)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        streams = list(pool.map(lambda j: servers.generate_stream(
            server.http, {"text_input": j[0], "max_tokens": j[1], "stream": True}), jobs))
    for (prompt, n), events in zip(jobs, streams):
        assert "".join(e["text_output"] for e in events) == offline(prompt, n), (prompt, n)
    _wait_pools_empty(server)


def test_tokens_reach_the_orchestrator_over_zeromq(server, offline):
    """Triton carries each request into generation once and generation answers it with one
    response (it is not decoupled), yet the client gets every token as its own delta: the
    tokens came over ZeroMQ. No postprocessing model is left: the orchestrator detokenizes."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(server.grpc) as client:
        models = {m.name for m in client.get_model_repository_index().models}
        assert "postprocessing" not in models and "orchestrator" in models
        assert not client.get_model_config("generation").config.model_transaction_policy.decoupled

        def executions() -> int:
            stats = client.get_inference_statistics("generation", as_json=True)["model_stats"][0]
            return int(stats.get("execution_count", 0))

        before = executions()
        events = servers.generate_stream(server.http, {"text_input": PROMPTS[0],
                                                       "max_tokens": 16, "stream": True})
        assert executions() - before == 1
    assert len([e for e in events if e["text_output"]]) > 8
    assert "".join(e["text_output"] for e in events) == offline(PROMPTS[0], 16)


def test_client_cancel_stops_generation_and_frees_blocks(server):
    servers.cancel_a_stream(server.grpc, server.metrics)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        outcomes = _gauges(server, "disagg_requests_total")
        if any("cancelled" in k and "generation" in k for k in outcomes):
            break
        time.sleep(0.25)
    else:
        raise AssertionError(f"generation did not see the stop: {outcomes}")
    _wait_pools_empty(server)


def test_unfetched_handoff_expires_and_foreign_handle_is_refused(server):
    import tritonclient.grpc as grpcclient

    from triton_disagg.kv import handle as kvhandle

    with grpcclient.InferenceServerClient(server.grpc) as client:
        inputs = servers.orchestrator_inputs(list(range(3, 40)), 8)[:3]
        result = client.infer("context", inputs,
                              parameters=_as_peer({"request_type": "context_only"}))
    handle = kvhandle.decode(result.as_numpy("context_phase_params")[0], SECRET.encode())
    assert handle.num_tokens == 37
    foreign = kvhandle.encode(dataclasses.replace(handle, fingerprint="0" * 64), SECRET.encode())
    with pytest.raises(RuntimeError, match="engine"):
        _generation_only(server, list(range(3, 40)) + [int(result.as_numpy("output_ids")[0, 0, 0])],
                         foreign)
    _wait_pools_empty(server)                   # the lease expired and its blocks came back
    deadline = time.monotonic() + 10
    while not sum(_gauges(server, "disagg_kv_leases_expired_total").values()):
        assert time.monotonic() < deadline, "the expired lease was not counted"
        time.sleep(0.25)


def test_handle_is_single_use_and_checked_before_use(server, offline):
    """Replaying a fetched handle, tampering with one, or sending garbage fails that request
    with a one-line reason; the server keeps serving and the secret stays private."""
    import tritonclient.grpc as grpcclient

    ids = list(range(3, 40))
    with grpcclient.InferenceServerClient(server.grpc) as client:
        result = client.infer("context", servers.orchestrator_inputs(ids, 8)[:3],
                              parameters=_as_peer({"request_type": "context_only"}))
    raw = result.as_numpy("context_phase_params")[0].tobytes()
    ids.append(int(result.as_numpy("output_ids")[0, 0, 0]))
    assert _generation_only(server, ids, raw)                 # its tokens came
    time.sleep(0.5)                                      # the context side saw the READ
    with pytest.raises(RuntimeError, match="already fetched"):
        _generation_only(server, ids, raw)
    from triton_disagg.kv.handle import FORMAT_VERSION

    deep = b"TDKV" + FORMAT_VERSION.to_bytes(2, "big") + (60_000).to_bytes(4, "big") + b"[" * 60_000
    for bad in (raw.replace(b'"num_tokens":37', b'"num_tokens":36'), raw[:-32], deep):
        with pytest.raises(RuntimeError, match="not signed by this deployment"):
            _generation_only(server, ids, bad)
    status, body = servers.generate(server.http, {"text_input": PROMPTS[0], "max_tokens": 8})
    assert status == 200 and body["text_output"] == offline(PROMPTS[0], 8), body
    _wait_pools_empty(server)
    for model in ("context", "generation"):
        with urllib.request.urlopen(f"{server.http}/v2/models/{model}/config") as resp:
            config = resp.read()
        assert SECRET.encode() not in config and b"kv_key_id" not in config   # settings.json
    assert SECRET not in server.server_log()


def _as_peer(parameters: dict) -> dict:
    """Request parameters as an orchestrator of this deployment sends them."""
    from triton_disagg import protocol as P
    from triton_disagg.triton.tensors import peer_credential

    return dict(parameters, **{P.PEER_CREDENTIAL: peer_credential()})


def _generation_only(served, ids, handle_bytes):
    """Call generation as the orchestrator does: Triton carries the request, its tokens come
    to a ZeroMQ socket of ours. The token ids, or RuntimeError with the request's error."""
    import uuid

    import tritonclient.grpc as grpcclient
    import zmq
    from tritonclient.utils import InferenceServerException

    from triton_disagg import token_wire
    from triton_disagg.zmq_endpoints import bind

    arrays = {"input_ids": np.array([ids], np.int32),
              "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[4]], np.int32),
              "context_phase_params": np.frombuffer(handle_bytes, np.uint8)[None, :]}
    tensors = []
    for name, arr in arrays.items():
        tensors.append(grpcclient.InferInput(name, list(arr.shape),
                                             grpcclient.np_to_triton_dtype(arr.dtype)))
        tensors[-1].set_data_from_numpy(arr)
    sock = zmq.Context.instance().socket(zmq.PULL)
    endpoint = bind(sock, None, "tokens")
    try:
        with grpcclient.InferenceServerClient(served.grpc) as client:
            try:
                client.infer("generation", tensors, request_id=uuid.uuid4().hex, parameters=_as_peer({
                    "request_type": "generation_only",
                    "token_address": token_wire.with_key(endpoint.address, "k")}))
            except InferenceServerException as exc:
                raise RuntimeError(exc.message()) from None
        tokens = []
        while True:
            assert sock.poll(60_000), "no token event from generation in 60 s"
            for event in token_wire.decode_events(sock.recv()):
                if event.error is not None:
                    raise RuntimeError(event.error)
                tokens += event.tokens
                if event.final:
                    return tokens
    finally:
        sock.close(linger=0)
        endpoint.release()


@pytest.mark.parametrize("flags", [[], ["--overlap_kv_transfer"]], ids=["", "overlap"])
def test_roles_as_separate_servers(demo_engine, tmp_path, offline, flags):
    """Prompts over max_local_prefill_length go through the context server; the short one
    ("a") is served whole by generation: the context server never sees it. With the guide's
    ``--overlap_kv_transfer`` on every role, generation reads the KV over gRPC-routed calls."""
    ctx_port, gen_port = servers.free_ports(2)
    config = _config(tmp_path / "disagg_config.yaml", demo_engine, "direct_transfer",
                     f'context_server: {{url: "localhost:{ctx_port}", cpus: [0]}}\n'
                     f'generation_server: {{url: "localhost:{gen_port}", '
                     f'max_local_prefill_length: 2}}\n')
    args = ["-c", str(config)] + flags
    with servers.serve("context", args + ["--log-format", "json"], tmp_path / "c", http=False,
                       grpc_port=ctx_port) as ctx, \
            servers.serve("generation", args, tmp_path / "g", http=False, grpc_port=gen_port), \
            servers.serve("scheduler", args, tmp_path / "s") as scheduler:
        for prompt in PROMPTS[:2]:
            status, body = servers.generate(scheduler.http, {"text_input": prompt, "max_tokens": 16})
            assert status == 200 and body["text_output"] == offline(prompt, 16), body
        deltas = servers.grpc_stream(scheduler.grpc, PROMPTS[2], 16)
        assert len(deltas) > 1 and "".join(deltas) == offline(PROMPTS[2], 16)
        contexts = _context_requests(ctx)
        assert contexts == 3
        status, body = servers.generate(scheduler.http, {"text_input": PROMPTS[3],
                                                         "max_tokens": 16})
        assert status == 200 and body["text_output"] == offline(PROMPTS[3], 16), body
        assert body["num_input_tokens"] <= 2 and _context_requests(ctx) == contexts
    overlapped = ctx.server_log().count("handed off (overlapped)")
    assert overlapped == (3 if flags else 0), ctx.server_log()[-2000:]


def _context_requests(served) -> float:
    from triton_disagg.routing.scrape import scrape, total

    return total(scrape(served.metrics), "nv_inference_request_success", model="context")


def test_layout_conversion_between_sides(demo_engine, tmp_path, offline):
    """Context keeps the engine's 16 tokens per block and float32 KV; generation uses 8
    tokens per block, or 32 with float16 KV. The receiver converts; greedy text equals the
    offline engine run with the generation side's KV dtype (prefill attends in float32 on
    both, and the KV it reads afterwards is rounded to float16 the same way)."""
    from triton_disagg.engine.spec import KVLayout

    offline_fp16 = servers.offline_text(demo_engine, KVLayout(tokens_per_block=32, dtype="float16"))
    for strategy, gen_kv, reference in (
            ("direct_transfer", "tokens_per_block: 8", offline),
            ("host_memory", "tokens_per_block: 32, kv_dtype: float16", offline_fp16),
            ("direct_transfer", "tokens_per_block: 32, kv_dtype: float16", offline_fp16)):
        config = _config(tmp_path / f"{strategy}.yaml", demo_engine, strategy,
                         f"generation_server: {{{gen_kv}}}\n")
        with servers.serve("all", ["-c", str(config)], tmp_path / strategy) as served:
            prompt = "The quick brown fox jumps over the lazy dog, again and again"
            status, body = servers.generate(served.http, {"text_input": prompt, "max_tokens": 12})
            assert status == 200 and body["num_output_tokens"] == 12, body
            assert body["text_output"] == reference(prompt, 12), (strategy, gen_kv)
            _wait_pools_empty(served)

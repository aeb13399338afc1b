"""Under KV pressure the context queues requests instead of refusing them (issue 28): a
`serve all` whose context pool holds two prompts' KV takes eight concurrent requests; each
gets its offline text, the context model receives exactly one call per request (Triton's
own count: no retries, no failed calls), and every block is free at the end. With
``host_memory`` the handoff's staging slots run out too (its pool blocks come back at
once), so a request also waits for staging room; with ``--overlap_kv_transfer`` generation
takes each request first and the context announces the KV as it prefills, and many at once
never wedge the two queues."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import servers
from triton_disagg.routing.scrape import scrape, total
from waiting import wait_until

REQUESTS = 8
MAX_TOKENS = 8
MAX_SEQ_LEN = 128    # so that a pool of 1 MB (15 KV blocks of 16 tokens, 64 KiB) is allowed
# ~105 tokens of the demo tokenizer: 7 blocks; the pool holds two such prompts on the
# context, and two such requests (prompt + MAX_TOKENS) on generation.
PROMPTS = [f"{i}: " + "The quick brown fox jumps over the lazy dog. " * 9 for i in range(REQUESTS)]


@pytest.fixture(scope="module")
def short_engine(demo_checkpoint, tmp_path_factory):
    """The demo engine built with ``MAX_SEQ_LEN``."""
    from triton_disagg.builders.build import build_engine

    path = tmp_path_factory.mktemp("short") / "engine"
    build_engine(demo_checkpoint, path, max_seq_len=MAX_SEQ_LEN)
    return path


@pytest.mark.parametrize("strategy, flags", [
    ("direct_transfer", []), ("host_memory", []),
    ("direct_transfer", ["--overlap_kv_transfer"])], ids=["direct", "host_memory", "overlap"])
def test_a_full_context_is_called_once_per_request_and_frees_every_block(
        short_engine, tmp_path, strategy, flags):
    offline = servers.offline_text(short_engine)
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {short_engine}, runtime: numpy, device: cpu}}\n"
                      f"kv_cache: {{strategy: {strategy}, max_size: 1MB, lease_seconds: 30}}\n")
    with servers.serve("all", ["-c", str(config)] + flags, tmp_path / "run") as served:
        with ThreadPoolExecutor(REQUESTS) as pool:
            results = list(pool.map(lambda p: servers.generate(
                served.http, {"text_input": p, "max_tokens": MAX_TOKENS}), PROMPTS))
        for prompt, (status, body) in zip(PROMPTS, results):
            assert status == 200 and body["text_output"] == offline(prompt, MAX_TOKENS), body
        samples = scrape(served.metrics)
        assert total(samples, "nv_inference_request_success", model="context") == REQUESTS
        assert total(samples, "nv_inference_request_failure", model="context") == 0
        assert total(samples, "nv_inference_exec_count", model="context") <= REQUESTS

        def at_rest() -> bool:
            samples = scrape(served.metrics)
            used = samples.get("disagg_kv_blocks_used", {})
            return len(used) == 2 and not any(used.values()) and not total(
                samples, "disagg_queued_prompt_tokens")
        wait_until(at_rest, 10, "0 KV blocks used and 0 prompt tokens queued on both roles")


def test_many_overlapped_requests_at_once_never_wedge_the_two_queues(short_engine, tmp_path):
    """24 overlapped requests at once, three rounds, on pools that hold two prompts each: all
    are served and every block is free after. Before the context waited for generation to
    hold a request's blocks, the two queues (in different orders) waited on each other: in
    six such rounds, 15 of the second round's requests and all of the next three rounds'
    timed out."""
    offline = servers.offline_text(short_engine)
    prompts = [f"{i}: " + PROMPTS[0].split(": ", 1)[1] for i in range(3 * REQUESTS)]
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {short_engine}, runtime: numpy, device: cpu}}\n"
                      f"kv_cache: {{strategy: direct_transfer, max_size: 1MB}}\n")
    with servers.serve("all", ["-c", str(config), "--overlap_kv_transfer"],
                       tmp_path / "run") as served:
        for _ in range(3):
            with ThreadPoolExecutor(len(prompts)) as pool:
                results = list(pool.map(lambda p: servers.generate(
                    served.http, {"text_input": p, "max_tokens": MAX_TOKENS}), prompts))
            for prompt, (status, body) in zip(prompts, results):
                assert status == 200 and body["text_output"] == offline(prompt, MAX_TOKENS), body

        def at_rest() -> bool:
            used = scrape(served.metrics).get("disagg_kv_blocks_used", {})
            return len(used) == 2 and not any(used.values())
        wait_until(at_rest, 10, "0 KV blocks used on both roles")


def test_a_request_that_waits_past_its_timeout_gets_a_timeout(short_engine, tmp_path,
                                                               monkeypatch):
    """Called as an orchestrator calls it (the peer credential; Triton's request timeout), a
    context whose pool two unfetched handoffs fill keeps a third request waiting, then
    answers it with a timeout one second (``WAIT_GRACE_SECONDS``) past its 0.5 s timeout;
    releasing the two handles empties the pool."""
    import time

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from triton_disagg import protocol as P
    from triton_disagg.errors import ErrorCode, from_grpc_status
    from triton_disagg.kv.secret import SECRET_ENV
    from triton_disagg.triton.tensors import peer_credential

    monkeypatch.setenv(SECRET_ENV, "test-deployment-secret-" + "7" * 32)
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {short_engine}, runtime: numpy, device: cpu}}\n"
                      f"kv_cache: {{strategy: direct_transfer, max_size: 1MB, "
                      f"lease_seconds: 60}}\n")
    def ids(n: int) -> list[int]:       # 7 blocks of the pool's 15; prompts share no block
        return list(range(3 + 100 * n, 3 + 100 * (n + 1)))

    def context(client, request_type=P.CONTEXT_ONLY, handle=None, timeout_us=0, n=0):
        inputs = servers.orchestrator_inputs(ids(n), MAX_TOKENS)[:3]
        if handle is not None:
            inputs += servers.array_inputs({P.CONTEXT_PHASE_PARAMS: handle[None]})
        return client.infer("context", inputs, timeout=timeout_us, parameters={
            P.REQUEST_TYPE: request_type, P.PEER_CREDENTIAL: peer_credential()})

    with servers.serve("all", ["-c", str(config)], tmp_path / "run") as served, \
            grpcclient.InferenceServerClient(served.grpc) as client:
        held = [context(client, n=n).as_numpy(P.CONTEXT_PHASE_PARAMS)[0] for n in range(2)]
        began = time.monotonic()
        with pytest.raises(InferenceServerException, match="past its deadline") as refused:
            context(client, timeout_us=500_000, n=2)
        assert 1.5 <= time.monotonic() - began < 10
        error = refused.value
        assert from_grpc_status(error.status(), error.message()) is ErrorCode.TIMEOUT, error
        for handle in held:
            context(client, P.RELEASE_KV, handle)

        def at_rest() -> bool:
            used = scrape(served.metrics).get("disagg_kv_blocks_used", {})
            return len(used) == 2 and not any(used.values())
        wait_until(at_rest, 10, "0 KV blocks used on both roles")

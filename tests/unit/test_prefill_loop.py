"""The context model's engine loop with a real engine and real KV exchange, without a
server: a full context (no KV blocks, or no host staging slots) makes a request wait in
the engine's queue, in order, until a handoff ends, instead of refusing it; a request
waits at most its deadline, a cancelled one is dropped; every request is answered exactly
once and every block comes back; the queued prompt tokens are counted."""

from __future__ import annotations

import threading
import time

import pytest

from context_loops import prefill, submit
from triton_disagg import protocol as P
from triton_disagg.config.settings import ContextSettings
from triton_disagg.context.prefill_loop import PrefillLoop, WAIT_GRACE_SECONDS
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.errors import Cancelled, ErrorCode, RequestError, Timeout
from triton_disagg.kv.secret import deployment_key, key_id
from triton_disagg.engine.sequence import EngineRequest
from waiting import wait_until

PROMPT = list(range(3, 63))      # 60 tokens: 4 blocks of 16
STILL_WAITING_S = 0.5            # long enough for the loop to have answered if it would


@pytest.fixture(params=["direct_transfer", "host_memory"])
def loop(request, demo_engine):
    if request.param == "direct_transfer":
        pytest.importorskip("nixl")
    from triton_disagg.engine.llm_engine import LLMEngine

    engine = LLMEngine(demo_engine, num_blocks=8)       # two prompts' KV, then full
    settings = ContextSettings(str(demo_engine), "disaggregated", (), None, None,
                               kv_strategy=request.param, kv_max_size=0, kv_lease_seconds=30.0,
                               stream_interval=1, kv_key_id=key_id(deployment_key()))
    loop = PrefillLoop(engine, settings, f"ctxtest_{request.param}")
    yield loop
    loop.close()


def _batch(*names: str) -> list[tuple[str, EngineRequest]]:
    """A request per name, each with a prompt of its own (no prefix the cache could share)."""
    return [(name, EngineRequest([3 + sum(map(ord, name))] + PROMPT[1:],
                                 SamplingParams(max_tokens=8), True)) for name in names]


def _handle(result) -> bytes:
    assert not isinstance(result, Exception), result
    return result[P.CONTEXT_PHASE_PARAMS].tobytes()


def test_a_full_context_makes_a_request_wait_until_a_handoff_ends(loop):
    """direct_transfer: the pool's blocks are leased; host_memory: the pool is free again but
    every staging slot holds KV (the handoff is full): either way "c" waits, unanswered,
    and gets its prefill once "a"'s KV is given back."""
    held = prefill(loop, _batch("a")) + prefill(loop, _batch("b"))
    assert all(_handle(r) for r in held)
    (waiting,) = submit(loop, _batch("c"))
    assert not waiting.done.wait(STILL_WAITING_S)
    assert loop.queued_tokens == len(PROMPT)
    loop.release(_handle(held[0]))                       # the client left after token 1
    assert _handle(waiting.result()) and waiting.results[1:] == []
    assert loop.queued_tokens == 0


def test_a_batch_that_does_not_fit_is_served_in_queue_order(loop):
    a, b, c, d = submit(loop, _batch("a", "b", "c", "d"))
    handles = [_handle(a.result()), _handle(b.result())]
    assert not c.done.wait(STILL_WAITING_S) and not d.done.is_set()
    loop.release(handles[0])
    assert _handle(c.result())
    assert not d.done.wait(STILL_WAITING_S)              # FIFO: d waits for the next room
    loop.release(handles[1])
    assert _handle(d.result())


def test_every_request_is_answered_once_and_every_block_comes_back(loop):
    """Eight requests at once over a pool for two: each is answered exactly once as blocks
    come back (here: a consumer gives each handle back as it arrives, as generation's fetch
    would), and the pool is empty at the end."""
    answers = submit(loop, _batch(*(f"r{i}" for i in range(8))))

    def consume():
        for answer in answers:
            loop.release(_handle(answer.result()))
    consumer = threading.Thread(target=consume)
    consumer.start()
    consumer.join(60)
    assert [len(a.results) for a in answers] == [1] * 8
    wait_until(lambda: loop.engine.pool.num_used == 0, 10, "every block back in the pool")


def test_a_request_waits_at_most_its_deadline(loop):
    held = prefill(loop, _batch("a", "b"))
    began = time.monotonic()
    (late,) = submit(loop, _batch("c"), wait_seconds=0.2)
    error = late.result()
    assert isinstance(error, Timeout) and error.status is ErrorCode.TIMEOUT, error
    assert "waited for KV blocks past its deadline" in str(error)
    assert 0.2 + WAIT_GRACE_SECONDS <= time.monotonic() - began < 0.2 + WAIT_GRACE_SECONDS + 2
    assert loop.queued_tokens == 0 and not loop.engine.scheduler.waiting
    for result in held:
        loop.release(_handle(result))
    wait_until(lambda: loop.engine.pool.num_used == 0, 10, "every block back in the pool")


def test_a_cancelled_waiting_request_is_dropped(loop):
    held = prefill(loop, _batch("a", "b"))
    (gone,) = submit(loop, _batch("c"))
    gone.cancel = True
    error = gone.result()
    assert isinstance(error, Cancelled) and error.status is ErrorCode.CANCELLED, error
    for result in held:
        loop.release(_handle(result))
    wait_until(lambda: loop.engine.pool.num_used == 0, 10, "every block back in the pool")


def test_a_prompt_the_pool_could_never_hold_and_a_queued_id_are_refused_at_once(loop):
    held = prefill(loop, _batch("a", "b"))
    (waiting,) = submit(loop, _batch("c"))
    (again,) = submit(loop, _batch("c"))
    assert isinstance(again.result(), RequestError) and "already in use" in str(again.results[0])
    huge = EngineRequest(list(range(3, 3 + 8 * 16 + 1)), SamplingParams(max_tokens=1), True)
    (refused,) = submit(loop, [("big", huge)])
    assert isinstance(refused.result(), RequestError) and "pool has 8" in str(refused.results[0])
    loop.release(_handle(held[0]))
    assert _handle(waiting.result())


def test_a_release_of_a_forged_handle_is_a_clear_error(loop):
    (held,) = prefill(loop, _batch("a"))
    forged = bytearray(_handle(held))
    forged[-1] ^= 1
    with pytest.raises(RequestError, match="context_phase_params: cannot release"):
        loop.release(bytes(forged))


def test_queued_prompt_tokens_count_waiting_requests_and_are_published(loop):
    """Requests waiting for blocks count their prompt tokens, which the loop publishes with
    the pool gauges; once answered they are off again."""
    class Gauges:                                   # the Metrics calls the loop makes
        def __init__(self):
            self.queued: list[int] = []
            self.used: list[int] = []

        def queued_prompt_tokens(self, tokens):
            self.queued.append(tokens)

        def kv_pool(self, stats):
            self.used.append(stats.used)

        def leases_expired(self, total):
            pass

    loop.metrics = Gauges()
    held = prefill(loop, _batch("a", "b"))
    waiting = submit(loop, _batch("c", "d"))
    wait_until(lambda: loop.metrics.queued and loop.metrics.queued[-1] == 2 * len(PROMPT), 5,
             "the waiting prompts' tokens published")
    for result in held:
        loop.release(_handle(result))
    for answer in waiting:
        loop.release(_handle(answer.result()))
    wait_until(lambda: loop.metrics.queued[-1] == 0 and loop.metrics.used[-1] == 0, 5,
             "0 queued tokens and 0 blocks used published at rest")


def test_a_device_kv_waits_for_staging_rows_not_for_an_error(demo_engine):
    """The torch runner with its KV apart from the host array (device memory on CUDA, faked
    on the CPU as in test_device_kv_staging) hands off through staging rows: 128 rows (one
    longest sequence) under a pool of 256 blocks. 32 prompts of 4 blocks take every row;
    a 33rd, whose pool blocks are free, waits for rows (it used to fail with HandoffBusy)
    and is prefilled once a handoff gives its rows back."""
    pytest.importorskip("nixl")
    from triton_disagg.engine.llm_engine import LLMEngine
    from triton_disagg.engine.runtime import Runtime

    engine = LLMEngine(demo_engine, num_blocks=256, runtime=Runtime("torch", "cpu", "float32"))
    engine.runner.kv = engine.runner.kv.clone()          # fake device memory
    engine.runtime = Runtime("torch", "cuda", "float32")  # so the connector stages it
    settings = ContextSettings(str(demo_engine), "disaggregated", (), None, None,
                               kv_strategy="direct_transfer", kv_max_size=0,
                               kv_lease_seconds=30.0, stream_interval=1,
                               kv_key_id=key_id(deployment_key()))
    loop = PrefillLoop(engine, settings, "ctxtest_rows")
    try:
        assert loop.connector.handoff_room() == 128
        held = prefill(loop, _batch(*(f"r{i}" for i in range(32))))
        assert loop.connector.handoff_room() == 0
        (waiting,) = submit(loop, _batch("last"))
        assert not waiting.done.wait(STILL_WAITING_S) and engine.pool.num_free >= 4
        loop.release(_handle(held[0]))
        assert _handle(waiting.result())
        for result in held[1:] + [waiting.results[0]]:
            loop.release(_handle(result))
        wait_until(lambda: engine.pool.num_used == 0, 10, "every block back in the pool")
    finally:
        loop.close()


def test_a_cached_prefix_is_handed_off_whole_and_freed_by_its_last_holder(loop):
    """A hit skips the shared prefix's prefill, the handle names every block of the prompt,
    and the shared blocks stay held until the last handle holding them is released."""
    from triton_disagg.engine.block_pool import block_hashes

    pool = loop.engine.pool
    params = SamplingParams(max_tokens=8)
    (a,) = prefill(loop, [("a", EngineRequest(PROMPT, params, True))])
    (b,) = prefill(loop, [("b", EngineRequest(PROMPT[:48] + [7] * 12, params, True))])
    assert pool.cache.hit_tokens == 48 and pool.cache.query_tokens == 2 * len(PROMPT)
    direct = loop.connector.strategy == "direct_transfer"
    if direct:                  # the blocks stay in the pool, leased to the two handles
        assert pool.num_used == 5
        shared = pool.match(block_hashes(PROMPT[:48], 16, loop.engine.cache_fingerprint))
        assert len(shared) == 3 and [pool.refcount(x) for x in shared] == [2, 2, 2]
    loop.release(_handle(a))
    if direct:
        wait_until(lambda: pool.num_used == 4, 5, "a's own block back")
        assert [pool.refcount(x) for x in shared] == [1, 1, 1]
    loop.release(_handle(b))
    wait_until(lambda: pool.num_used == 0, 5, "every block back")
    assert pool.num_cached == 3             # the full blocks; the partial tails are private

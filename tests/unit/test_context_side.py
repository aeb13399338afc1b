"""The context model's logic with a real engine and real KV exchange, without a server:
a context instance never waits for memory (it answers busy at once), gives back a
handoff that nobody will fetch, and counts the prompt tokens it has not prefilled yet."""

from __future__ import annotations

import time

import pytest

from triton_disagg import protocol as P
from triton_disagg.config.settings import ContextSettings
from triton_disagg.engine.prefix_hash import block_hashes
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.kv.secret import deployment_key, key_id
from triton_disagg.context.prefill import ContextSide
from triton_disagg.triton.engine_request import EngineRequest
from triton_disagg.errors import RequestError

PROMPT = list(range(3, 63))      # 60 tokens: 4 blocks of 16


@pytest.fixture(params=["direct_transfer", "host_memory"])
def side(request, demo_engine):
    if request.param == "direct_transfer":
        pytest.importorskip("nixl")
    from triton_disagg.engine.llm_engine import LLMEngine

    engine = LLMEngine(demo_engine, num_blocks=8)       # two prompts' KV, then full
    settings = ContextSettings(str(demo_engine), "disaggregated", (), None, None,
                               kv_strategy=request.param, kv_max_size=0, kv_lease_seconds=30.0,
                               stream_interval=1, kv_key_id=key_id(deployment_key()))
    side = ContextSide(engine, settings, f"ctxtest_{request.param}")
    yield side
    side.close()


def _prefill(side: ContextSide, *names: str, prompt: list[int] | None = None) -> list:
    """Prefill a request per name; each name's own prompt (no prefix shared), unless given."""
    return side.prefill([(name, EngineRequest(prompt or [t + ord(name[0]) % 7 for t in PROMPT],
                                              SamplingParams(max_tokens=8), True))
                         for name in names])


def _until(predicate) -> None:
    deadline = time.monotonic() + 5
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_cached_prefix_is_handed_off_whole_and_freed_by_its_last_holder(side):
    """A hit skips the shared prefix's prefill, the handle names every block of the prompt,
    and the shared blocks stay held until the last handle holding them is released."""
    pool = side.engine.pool
    a, = _prefill(side, "a", prompt=PROMPT)
    b, = _prefill(side, "b", prompt=PROMPT[:48] + [7] * 12)      # 3 blocks of 16 shared
    assert pool.cache.hit_tokens == 48 and pool.cache.query_tokens == 2 * len(PROMPT)
    direct = side.connector.strategy == "direct_transfer"
    if direct:                  # the blocks stay in the pool, leased to the two handles
        assert pool.num_used == 5
        shared = pool.match(block_hashes(PROMPT[:48], 16, side.engine.cache_fingerprint))
        assert len(shared) == 3 and [pool.refcount(x) for x in shared] == [2, 2, 2]
    side.release(a[P.CONTEXT_PHASE_PARAMS].tobytes())
    if direct:
        _until(lambda: pool.num_used == 4)
        assert [pool.refcount(x) for x in shared] == [1, 1, 1]
    side.release(b[P.CONTEXT_PHASE_PARAMS].tobytes())
    _until(lambda: pool.num_used == 0)
    assert pool.num_cached == 3             # the full blocks; the partial tails are private


def test_a_full_context_answers_busy_at_once_and_a_release_makes_room(side):
    held = _prefill(side, "a") + _prefill(side, "b")       # every block (or slot) handed off
    assert all(P.CONTEXT_PHASE_PARAMS in r and r[P.CONTEXT_PHASE_PARAMS].size for r in held)
    started = time.monotonic()
    busy, = _prefill(side, "c")
    assert time.monotonic() - started < 1.0        # no wait for memory inside execute
    assert isinstance(busy, RequestError) and str(busy).startswith(P.CONTEXT_BUSY)
    side.release(held[0][P.CONTEXT_PHASE_PARAMS].tobytes())   # the client left after token 1
    deadline = time.monotonic() + 5
    while isinstance(_retry := _prefill(side, "c")[0], RequestError) and time.monotonic() < deadline:
        time.sleep(0.01)                           # direct_transfer: freed on the watcher
    assert P.CONTEXT_PHASE_PARAMS in _retry


def test_a_batch_that_does_not_fit_serves_what_fits(side):
    results = _prefill(side, "a", "b", "c")
    assert [isinstance(r, RequestError) for r in results] == [False, False, True]
    assert str(results[2]).startswith(P.CONTEXT_BUSY)


def test_a_release_of_a_forged_handle_is_a_clear_error(side):
    held, = _prefill(side, "a")
    forged = bytearray(held[P.CONTEXT_PHASE_PARAMS].tobytes())
    forged[-1] ^= 1
    with pytest.raises(RequestError, match="context_phase_params: cannot release"):
        side.release(bytes(forged))


def test_queued_prompt_tokens_count_a_batch_until_it_is_prefilled(side):
    """A batch waiting for the engine (another prefill holds its lock) counts its prompt
    tokens, and the reporter publishes them; once answered they are off again."""
    import threading

    class Gauges:                                   # the Metrics calls the reporter makes
        def __init__(self):
            self.queued: list[int] = []

        def queued_prompt_tokens(self, tokens):
            self.queued.append(tokens)

        def kv_pool(self, stats):
            pass

        def leases_expired(self, total):
            pass

    side.metrics = Gauges()
    _until(lambda: side.metrics.queued)   # a report just went: the next is REPORT_SECONDS away
    with side.lock:                                 # the engine is busy
        batch = threading.Thread(target=_prefill, args=(side, "a", "b"))
        batch.start()
        _until(lambda: side.queued_tokens == 2 * len(PROMPT))
        _until(lambda: side.metrics.queued[-1] == 2 * len(PROMPT))
    batch.join(10)
    assert side.queued_tokens == 0

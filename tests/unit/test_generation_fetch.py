"""Generation's KV fetches in flight, without a server: a fetch on the real fetch thread
does not hold up the decode loop (and the metrics say how much of it other work hid), KV
that moved is counted even when its request then fails, and a next turn fetches only the
blocks generation's prefix cache lacks (or is served here without the context). The pools
and the copy between them: tests/support/generation_fakes.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from generation_fakes import WAIT_SECONDS, Copied, CopyConnector, CopyHandle, Finals, \
    handed_off, two_pools
from triton_disagg import protocol as P
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.engine.sequence import EngineRequest
from triton_disagg.generation.decode_loop import DecodeLoop
from triton_disagg.kv.connector import FetchWorker
from triton_disagg.kv.handle import TransferStats


@pytest.fixture
def sides(demo_engine):
    return two_pools(demo_engine)


class ThreadedCopyConnector(CopyConnector):
    """The same copy on a real fetch thread (:class:`FetchWorker`, as the connectors run
    it); a request's copy waits until its id is in ``opened``."""

    def __init__(self, context: LLMEngine, generation: LLMEngine):
        super().__init__(context, generation)
        self.worker, self.opened = FetchWorker("test"), threading.Condition()
        self.open_ids: set[str] = set()
        self.fetching: set[str] = set()         # requests whose fetch the loop started

    def start_fetch(self, handle: CopyHandle, reserved, cached_blocks=0):
        with self.opened:
            self.fetching.add(handle.request_id)
            self.opened.notify_all()

        def copy(deadline: float) -> TransferStats:
            with self.opened:
                self.opened.wait_for(lambda: handle.request_id in self.open_ids,
                                     max(0.0, deadline - time.monotonic()))
            return CopyConnector.start_fetch(self, handle, reserved).poll()

        return self.worker.submit(copy, WAIT_SECONDS, f"test {handle.request_id}")

    def open(self, request_id: str) -> None:
        with self.opened:
            self.open_ids.add(request_id)
            self.opened.notify_all()

    def wait_started(self, request_ids: set[str]) -> bool:
        with self.opened:
            return self.opened.wait_for(lambda: request_ids <= self.fetching, WAIT_SECONDS)

    def close(self):
        self.worker.close()


class FetchMetrics:
    """The side's metrics: records each ``kv_transfer`` (in flight, hidden) and the bytes
    it moved, in order."""

    def __init__(self):
        self.fetches: list[tuple[float, float]] = []
        self.moved: list[int] = []

    def kv_transfer(self, strategy, nbytes, seconds, in_flight_seconds, hidden_seconds):
        self.fetches.append((in_flight_seconds, hidden_seconds))
        self.moved.append(nbytes)

    def __getattr__(self, name):
        return lambda *args: None                # the gauges and counters: not under test


class RefusedFirstToken(CopyConnector):
    """An overlapped transfer's end as the engine may meet it: the KV copied, but the first
    token it brings is outside the vocabulary, so the engine refuses it."""

    MOVED = 4096

    def start_fetch(self, handle, reserved, cached_blocks=0):
        super().start_fetch(handle, reserved, cached_blocks)
        return Copied(TransferStats(self.MOVED, 0.01, first_token=10**6))


def test_kv_that_moved_counts_even_when_its_first_token_is_refused(sides):
    context, side = sides
    side.connector = RefusedFirstToken(context, side.engine)
    side.metrics = metrics = FetchMetrics()
    finals = Finals()
    loop = DecodeLoop(side.engine, finals, side)
    try:
        _, request, kv = handed_off(context, side, "r", [5, 6, 7], SamplingParams(max_tokens=4))
        loop.submit("r", request, "ipc:///orchestrator#k", kv)
        assert finals.wait(1), "the request never ended"
    finally:
        loop.close()
    (event,) = finals.emits["r"]
    assert event.final and "outside the vocabulary" in event.error
    assert metrics.moved == [RefusedFirstToken.MOVED]       # its bytes are in the metrics
    assert side.engine.pool.num_used == 0 and context.pool.num_used == 0


def test_the_decode_loop_finishes_a_request_while_another_fetch_blocks(sides):
    context, side = sides
    side.connector = threaded = ThreadedCopyConnector(context, side.engine)
    side.metrics = metrics = FetchMetrics()
    finals = Finals()
    loop = DecodeLoop(side.engine, finals, side)
    prompts = {"ok": [7, 8, 9], "slow": [5, 6, 7, 8, 9]}       # ok's fetch runs first
    params, firsts = SamplingParams(max_tokens=5), {}
    try:
        for rid, prompt in prompts.items():
            firsts[rid], request, kv = handed_off(context, side, rid, prompt, params)
            loop.submit(rid, request, "ipc:///orchestrator#k", kv)
        assert threaded.wait_started(set(prompts))   # both in flight before ok's KV lands
        threaded.open("ok")
        assert finals.wait(1), "a blocked fetch held up the other request"
        assert set(finals.emits) == {"ok"}                       # slow is still fetching
        threaded.open("slow")
        assert finals.wait(2), "the blocked fetch never finished"
    finally:
        loop.close()
        threaded.close()
    for rid, prompt in prompts.items():
        (whole,) = context.generate([prompt], params)
        assert [firsts[rid]] + finals.tokens(rid) == whole.output_ids
    assert side.engine.pool.num_used == 0 and context.pool.num_used == 0
    (ok_in_flight, ok_hidden), (slow_in_flight, slow_hidden) = metrics.fetches
    assert ok_hidden == 0.0                           # nothing else ran while it moved
    assert 0 < slow_hidden <= slow_in_flight          # ok decoded while slow's KV waited


class SkippingCopyConnector(CopyConnector):
    """A copy that leaves out the blocks generation's prefix cache holds, as the real
    connectors do (``start_fetch``'s ``cached_blocks``); each start's count is recorded."""

    def __init__(self, context: LLMEngine, generation: LLMEngine):
        super().__init__(context, generation)
        self.skipped: list[int] = []

    def can_skip(self, handle: CopyHandle) -> bool:
        return True

    def start_fetch(self, handle: CopyHandle, reserved, cached_blocks=0):
        self.skipped.append(cached_blocks)
        blocks = list(reserved[cached_blocks:len(handle.block_ids)])
        self.generation.pool.write_blocks(
            blocks, self.context.pool.read_blocks(handle.block_ids[cached_blocks:]))
        self.context.pool.free(handle.block_ids)        # the handoff ends as a whole
        return Copied(TransferStats(0, 0.0))


def test_a_next_turn_takes_generations_cached_blocks_and_may_skip_the_context(sides):
    """Generation's prefix cache (issue 29 item 3): after turn 1 (8 prompt tokens, 5 output:
    3 blocks of 4 tokens of KV cached when it ends), turn 2 (turn 1's prompt and output plus
    3 tokens) takes those 3 blocks and fetches only the rest, with the uncached run's
    tokens; context_and_generation_if_cached is served here when at most ``local_prefill``
    of a prompt's tokens are not cached (turn 2's 4), else declined (None)."""
    context, side = sides
    side.connector = SkippingCopyConnector(context, side.engine)
    params, finals = SamplingParams(max_tokens=5), Finals()      # end_id None: 5 tokens
    loop = DecodeLoop(side.engine, finals, side)
    first = list(range(5, 13))
    try:
        token, request, kv = handed_off(context, side, "one", first, params)
        loop.submit("one", request, "ipc:///orchestrator#k", kv)
        assert finals.wait(1)
        second = first + [token] + finals.tokens("one") + [40, 41, 42]     # 16 tokens
        token, request, kv = handed_off(context, side, "two", second, params)
        loop.submit("two", request, "ipc:///orchestrator#k", kv)
        assert finals.wait(2)
    finally:
        loop.close()
    assert side.connector.skipped == [0, 3]
    (whole,) = context.generate([second], params)
    assert [token] + finals.tokens("two") == whole.output_ids
    assert side.engine.pool.cache.hit_tokens == 12
    assert side.engine.pool.num_used == 0 and context.pool.num_used == 0
    request = EngineRequest(second, params, streaming=False)
    offer = P.CONTEXT_AND_GENERATION_IF_CACHED
    for local_prefill, served in ((3, False), (4, True)):
        side.local_prefill = local_prefill
        assert side.declines(offer, request) is not served
        assert side.prompt_kv(offer, request, {}) is None        # served: prefilled here

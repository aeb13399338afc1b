"""Generation-side admission: a sequence enters the engine only with every KV block it
will hold, FIFO; a request that can never fit is refused at once; a pool that cannot
hold one max_seq_len sequence is refused at start-up.

The generation pool here has 10 blocks of 4 tokens; a "4+4" request has a 16-token
prompt (4 blocks of KV fetched) and 17 max_tokens (4 more blocks to decode into). The KV
moves by a plain copy between the two pools (:class:`CopyConnector`): the transports have
their own tests (test_kv_exchange.py); these are about when and into what it moves.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from triton_disagg.kv.connector import FetchWorker, Transfer
from triton_disagg import protocol as P
from triton_disagg.config.settings import GenerationSettings
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.engine.spec import KVLayout
from triton_disagg.errors import UserError
from triton_disagg.engine.sequence import EngineRequest
from triton_disagg.generation.decode_loop import DecodeAdmission, DecodeLoop, FetchedKV
from triton_disagg.kv.handle import TransferStats

LAYOUT = KVLayout(tokens_per_block=4, dtype="float32")
WAIT_SECONDS = 20.0


@dataclass(frozen=True)
class Copied(Transfer):
    """The Transfer of a copy done inside ``start_fetch``: polls done at once."""

    stats: TransferStats

    def poll(self) -> TransferStats:
        return self.stats


@dataclass(frozen=True)
class CopyHandle:
    num_tokens: int
    block_ids: list[int]          # in the context pool, which the handle owns
    request_id: str


class CopyConnector:
    """The connector's ``start_fetch`` contract over a plain copy: fill the first blocks of
    the reservation with the handle's KV, then free the context blocks (as a transport
    does); the fetch is complete when it returns. Each start is recorded, and waits for
    ``release``: the loop then meets every submitted request at once (as under load),
    deterministically."""

    strategy = "copy"

    def __init__(self, context: LLMEngine, generation: LLMEngine):
        self.context, self.generation = context, generation
        self.started, self.release = [], threading.Event()
        self.release.set()
        self.failing: set[str] = set()          # request ids whose fetch raises

    def can_skip(self, handle: CopyHandle) -> bool:
        return False                            # copies every block

    def start_fetch(self, handle: CopyHandle, reserved, cached_blocks=0):
        self.started.append(handle.request_id)
        self.release.wait(WAIT_SECONDS)
        if handle.request_id in self.failing:
            self.context.pool.free(handle.block_ids)
            raise RuntimeError(f"KV lease of {handle.request_id} expired")
        blocks = list(reserved[:len(handle.block_ids)])
        self.generation.pool.write_blocks(blocks, self.context.pool.read_blocks(handle.block_ids))
        self.context.pool.free(handle.block_ids)
        return Copied(TransferStats(0, 0.0))

    def close(self):
        pass


@pytest.fixture
def sides(demo_engine):
    context = LLMEngine(demo_engine, num_blocks=64, kv_layout=LAYOUT)
    generation = LLMEngine(demo_engine, num_blocks=10, kv_layout=LAYOUT)
    side = DecodeAdmission(generation, None)
    side.connector = CopyConnector(context, generation)
    return context, side


class Finals:
    """The loop's outbox: collects each request's token events; ``wait(n)`` until n
    requests have their final one."""

    def __init__(self):
        self.emits: dict[str, list] = {}
        self.cond = threading.Condition()

    def put(self, address, event):
        with self.cond:
            self.emits.setdefault(event.request_id, []).append(event)
            self.cond.notify_all()

    max_sockets = 64

    def flush(self, keep=()):
        return {}                          # every event reached its orchestrator

    def close(self):
        pass

    def wait(self, n: int, timeout: float = WAIT_SECONDS) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: sum(e.final for v in self.emits.values()
                                                  for e in v) >= n, timeout)

    def tokens(self, rid: str) -> list[int]:
        return [t for event in self.emits[rid] for t in event.tokens]


class StopsFor:
    """The control socket, as the loop sees it: a stop for ``request_id`` at every poll
    (a stop for a request the loop no longer holds is ignored)."""

    def __init__(self, request_id: str):
        self.request_id = request_id

    def take(self) -> list[tuple[str, str]]:
        return [(self.request_id, "k")]

    def close(self):
        pass


def handed_off(context, side, rid, prompt, params):
    """Prefill ``prompt`` on the context engine: its first token, and the generation_only
    request with the KV ``side`` fetches for it."""
    (result,) = context.prefill_only([(rid, prompt, params)])
    request = EngineRequest(prompt + [result.token_id], params, streaming=False)
    handle = CopyHandle(result.num_tokens, result.block_ids, rid)
    return result.token_id, request, FetchedKV(side.connector, handle)


def test_requests_that_fit_one_at_a_time_all_finish_in_fifo_order(sides):
    context, side = sides
    requests = {"a": (list(range(5, 21)), SamplingParams(max_tokens=17)),    # 4+4 blocks
                "b": (list(range(30, 46)), SamplingParams(max_tokens=17)),   # 4+4 blocks
                "c": ([7, 8, 9, 10], SamplingParams(max_tokens=5))}          # 1+1 blocks
    gated, finals = side.connector, Finals()
    gated.release.clear()
    loop = DecodeLoop(side.engine, finals, side, stops=StopsFor("d"))
    firsts = {}
    for rid, (prompt, params) in requests.items():
        firsts[rid], request, kv = handed_off(context, side, rid, prompt, params)
        loop.submit(rid, request, "ipc:///orchestrator#k", kv)
    # d's client is gone before d reaches the head: it ends without taking any block.
    _, cancelled, cancelled_kv = handed_off(context, side, "d", [7, 8, 9],
                                            SamplingParams(max_tokens=3))
    loop.submit("d", cancelled, "ipc:///orchestrator#k", cancelled_kv)
    gated.release.set()
    try:
        assert finals.wait(4), "admission deadlock: the requests never all finished"
    finally:
        loop.close()
    # c would fit beside a, but waits behind b (FIFO); each is admitted once, no retries.
    assert gated.started == ["a", "b", "c"]
    (event,) = finals.emits["d"]
    assert event.error is None and event.finish_reason == "cancelled" and event.tokens == []
    context.pool.free(cancelled_kv.handle.block_ids)        # as its lease expiring would
    for rid, (prompt, params) in requests.items():
        (whole,) = context.generate([prompt], params)
        assert [firsts[rid]] + finals.tokens(rid) == whole.output_ids
        assert [e.final for e in finals.emits[rid]] == [True] and finals.emits[rid][0].error is None
    assert side.engine.pool.num_used == 0 and context.pool.num_used == 0


def test_a_request_the_pool_can_never_hold_is_refused_at_once(sides):
    context, side = sides
    finals = Finals()
    loop = DecodeLoop(side.engine, finals, side)
    # 48 prompt tokens (12 blocks) + 4: the prompt alone outgrows the 10-block pool.
    _, request, kv = handed_off(context, side, "big", list(range(5, 53)),
                         SamplingParams(max_tokens=4))
    loop.submit("big", request, "ipc:///orchestrator#k", kv)
    _, request, kv = handed_off(context, side, "ok", [7, 8, 9], SamplingParams(max_tokens=3))
    loop.submit("ok", request, "ipc:///orchestrator#k", kv)
    try:
        assert finals.wait(2, timeout=5.0), "the never-fitting request waits for ever"
    finally:
        loop.close()
    (event,) = finals.emits["big"]
    error = event.error
    assert event.tokens == [] and error is not None
    for part in ("51 tokens of KV", "13 KV blocks", "10 blocks", "40 tokens",
                 "raise kv_cache.max_size", "lower max_tokens"):
        assert part in error, (part, error)
    assert finals.emits["ok"][-1].error is None and side.engine.pool.num_used == 0


def test_a_failing_fetch_fails_its_request_alone_and_frees_its_blocks(sides):
    context, side = sides
    side.connector.failing.add("lost")
    finals = Finals()
    loop = DecodeLoop(side.engine, finals, side)
    prompts = {"lost": [5, 6, 7, 8, 9], "ok": [7, 8, 9]}
    firsts = {}
    for rid, prompt in prompts.items():
        firsts[rid], request, kv = handed_off(context, side, rid, prompt,
                                              SamplingParams(max_tokens=4))
        loop.submit(rid, request, "ipc:///orchestrator#k", kv)
    try:
        assert finals.wait(2), "a request never ended"
    finally:
        loop.close()
    (event,) = finals.emits["lost"]
    assert event.tokens == [] and event.error == "KV lease of lost expired"
    (whole,) = context.generate([prompts["ok"]], SamplingParams(max_tokens=4))
    assert [firsts["ok"]] + finals.tokens("ok") == whole.output_ids
    assert [e.final for e in finals.emits["ok"]] == [True] and finals.emits["ok"][0].error is None
    assert side.engine.pool.num_used == 0 and context.pool.num_used == 0


def test_pool_too_small_for_one_max_seq_len_sequence_is_refused_at_start(demo_engine):
    from triton_disagg.config.disagg import parse_config
    from triton_disagg.engine.spec import EngineSpec
    from triton_disagg.engine.capacity import check_kv_capacity
    from triton_disagg.engine.capacity import make_engine

    spec = EngineSpec.load(demo_engine)
    geometry = spec.block_geometry()
    need = geometry.blocks_for(spec.max_context - 1)
    enough = need * geometry.block_nbytes

    def config(max_size, **generation):
        return parse_config({"model": {"engine": str(demo_engine)},
                             "kv_cache": {"max_size": max_size},
                             "generation_server": generation}, source="disagg.yaml")

    check_kv_capacity(config(enough))
    with pytest.raises(UserError) as refused:
        check_kv_capacity(config(enough - 1))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("disagg.yaml: kv_cache.max_size")
    for part in (f"{need - 1} KV blocks", f"needs {need}", "context instance",
                 "raise kv_cache.max_size to at least"):
        assert part in message, (part, message)
    # float16 KV halves the block: the same budget serves generation, not context.
    with pytest.raises(UserError, match="context instance"):
        check_kv_capacity(config(enough // 2, kv_dtype="float16"))
    aggregated = parse_config({"model": {"engine": str(demo_engine)}, "mode": "aggregated",
                               "kv_cache": {"max_size": enough // 2},
                               "generation_server": {"kv_dtype": "float16"}})
    check_kv_capacity(aggregated)                  # no context model in aggregated mode
    settings = GenerationSettings(str(demo_engine), "disaggregated", (), None, None,
                                  "direct_transfer", kv_max_size=enough - 1,
                                  kv_lease_seconds=30.0, stream_interval=1)
    with pytest.raises(UserError, match="generation instance.*raise kv_cache.max_size"):
        make_engine(settings, "generation")


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

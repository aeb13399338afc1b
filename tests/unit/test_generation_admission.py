"""Generation-side admission: a sequence enters the engine only with every KV block it
will hold, FIFO; a request that can never fit is refused at once; a failing fetch fails its
request alone; an overlapped request's orchestrator hears when it holds its blocks (then
calls the context); a pool that cannot hold one max_seq_len sequence is refused at start-up.

The generation pool here has 10 blocks of 4 tokens; a "4+4" request has a 16-token
prompt (4 blocks of KV fetched) and 17 max_tokens (4 more blocks to decode into). The KV
moves by a plain copy between the two pools (tests/support/generation_fakes.py); these tests
are about when and into what it moves.
"""

from __future__ import annotations

import pytest

from generation_fakes import WAIT_SECONDS, Finals, StopsFor, handed_off, two_pools
from triton_disagg.config.settings import GenerationSettings
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.engine.sequence import EngineRequest
from triton_disagg.errors import UserError
from triton_disagg.generation.decode_loop import DecodeLoop, PulledKV
from triton_disagg.kv.connector import Transfer


@pytest.fixture
def sides(demo_engine):
    return two_pools(demo_engine)


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


class _Pending(Transfer):
    """An overlapped pull whose context was never called: in flight until cancelled, or
    ``ended`` already (its deadline passed while the sequence waited for blocks)."""

    def __init__(self, ended: bool = False):
        self.cancelled, self.ended = False, ended

    def poll(self):
        if self.ended:
            raise RuntimeError("no handle from the context in time")
        if self.cancelled:
            raise RuntimeError("cancelled")
        return None

    def cancel(self):
        self.cancelled = True


class _Pulls:
    """Generation's connector for overlapped requests, as the engine sees it: each pull
    started is recorded (its nonce) and stays in flight until cancelled."""

    strategy = "pull"

    def __init__(self, ended: bool = False):
        self.started: list[str] = []
        self.ended = ended

    def start_pull(self, nonce, block_ids, cached_blocks=0):
        self.started.append(nonce)
        return _Pending(self.ended)

    def close(self):
        pass


class _StopsLater:
    """The control socket: the stops the test puts in ``ids`` (key "k"), at the next poll."""

    def __init__(self):
        self.ids: list[str] = []

    def take(self):
        ids, self.ids = self.ids, []
        return [(rid, "k") for rid in ids]

    def close(self):
        pass


def test_an_overlapped_request_is_told_once_it_holds_its_blocks_not_before(sides):
    """CI's overlapped test timed out: generation answered an overlapped request at once and
    the orchestrator called the context, whose pool could fill with KV of requests that
    generation had no blocks for yet, while generation's blocks waited for KV the context
    had no room to prefill (the two queues in different orders). The orchestrator now hears
    when generation's queue gives the request its blocks (an event with no tokens, its
    first), and only then calls the context: "b", queued behind "a" in a full pool, hears
    nothing until "a" leaves."""
    _, side = sides
    side.connector, stops, finals = _Pulls(), _StopsLater(), Finals()
    loop = DecodeLoop(side.engine, finals, side, stops=stops)

    def told(rid: str) -> bool:
        with finals.cond:
            return finals.cond.wait_for(lambda: rid in finals.emits, WAIT_SECONDS)
    try:
        for rid in ("a", "b"):           # 20 prompt tokens: 5 blocks + 1 of room, of 10
            request = EngineRequest(list(range(5, 25)), SamplingParams(max_tokens=4), True)
            loop.submit(rid, request, "ipc:///orchestrator#k",
                        PulledKV(side.connector, f"nonce-{rid}", 20, b"listener"))
        assert told("a")
        (taken,) = finals.emits["a"]
        assert (taken.tokens, taken.final, taken.seq, taken.key) == ([], False, 0, "k")
        assert "b" not in finals.emits and side.connector.started == ["nonce-a"]
        stops.ids.append("a")            # a's client left: its blocks go to b
        assert told("b")
        assert finals.emits["b"][0].tokens == [] and not finals.emits["b"][0].final
        assert side.connector.started == ["nonce-a", "nonce-b"]
        stops.ids.append("b")
        assert finals.wait(2)
    finally:
        loop.close()
    assert finals.emits["a"][-1].finish_reason == "cancelled"
    assert side.engine.pool.num_used == 0


def test_a_pull_that_ended_before_it_started_tells_its_error_not_that_it_was_taken(sides):
    """A pull whose wait ended while its sequence was queued fails in the step that starts
    it: the orchestrator hears the error alone, so it never calls the context for it."""
    _, side = sides
    side.connector, finals = _Pulls(ended=True), Finals()
    loop = DecodeLoop(side.engine, finals, side)
    request = EngineRequest(list(range(5, 25)), SamplingParams(max_tokens=4), True)
    loop.submit("late", request, "ipc:///orchestrator#k",
                PulledKV(side.connector, "nonce-late", 20, b"listener"))
    try:
        assert finals.wait(1)
    finally:
        loop.close()
    (event,) = finals.emits["late"]
    assert event.seq == 0 and event.error == "no handle from the context in time"
    assert side.engine.pool.num_used == 0


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

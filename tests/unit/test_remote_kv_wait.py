"""The scheduler's waiting-for-remote-KV state, with fetches the test completes by hand:
a request whose fetch has not completed holds its blocks but does not decode while the
others do; it joins the batch when its fetch polls done; a failed fetch ends that request
alone and frees its blocks; an abort during a fetch frees the blocks once it ends. Then the
same on a real fetch thread (:class:`FetchWorker`) whose fetch blocks on an Event: the
engine keeps stepping, a fetch past its deadline fails alone, a cancel frees the blocks
once the thread let go of them."""

from __future__ import annotations

import threading
import time

import pytest

from triton_disagg.kv.connector import FetchWorker, Transfer
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.errors import RequestError
from triton_disagg.engine.spec import KVLayout
from triton_disagg.kv.handle import TransferStats

LAYOUT = KVLayout(tokens_per_block=4, dtype="float32")
PARAMS = SamplingParams(max_tokens=6)
WAIT_S = 20.0


class ManualKV(Transfer):
    """A RemoteKV whose fetch copies the context's blocks at start but completes only when
    the test sets ``outcome`` (a result, or an exception to raise)."""

    def __init__(self, context: LLMEngine, generation: LLMEngine, block_ids: list[int],
                 num_tokens: int):
        self.context, self.generation = context, generation
        self.src, self.num_tokens = block_ids, num_tokens
        self.outcome = None

    skips_cached = False           # copies every block

    def start(self, block_ids, cached_blocks=0):
        dst = block_ids[:len(self.src)]
        self.generation.pool.write_blocks(dst, self.context.pool.read_blocks(self.src))
        return self

    def poll(self):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


@pytest.fixture
def engines(demo_engine):
    return (LLMEngine(demo_engine, num_blocks=64, kv_layout=LAYOUT),
            LLMEngine(demo_engine, num_blocks=32, kv_layout=LAYOUT))


def handed_off(engines, rid, prompt):
    """Prefill on the context engine; the generation request's first token and its KV."""
    context, generation = engines
    (result,) = context.prefill_only([(rid, prompt, PARAMS)])
    return result.token_id, ManualKV(context, generation, result.block_ids, result.num_tokens)


def run(generation, steps: int) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(steps):
        for event in generation.step():
            tokens.setdefault(event.request_id, []).append(event.tokens[0])
    return tokens


def test_a_request_decodes_only_once_its_kv_has_arrived(engines):
    context, generation = engines
    prompts = {"slow": [5, 6, 7, 8, 9], "fast": [11, 12, 13]}
    kvs, firsts = {}, {}
    for rid, prompt in prompts.items():
        firsts[rid], kvs[rid] = handed_off(engines, rid, prompt)
        generation.add_prefilled(rid, prompt, firsts[rid], PARAMS, kvs[rid])
    kvs["fast"].outcome = TransferStats(1, 0.0)
    early = run(generation, 3)
    slow = generation.scheduler.find("slow")
    assert "slow" not in early and len(early["fast"]) == 3      # the others keep decoding
    assert slow.status == "waiting_for_remote_kv" and generation.admitted("slow")
    assert len(slow.block_table.block_ids) == generation.pool.geometry.blocks_for(5 + 6 - 1)
    assert [(a.request_id, a.result) for a in generation.take_kv_arrivals()] == \
        [("fast", TransferStats(1, 0.0))]
    kvs["slow"].outcome = TransferStats(2, 0.0)
    late = run(generation, 8)
    assert [(a.request_id, a.result) for a in generation.take_kv_arrivals()] == \
        [("slow", TransferStats(2, 0.0))]
    for rid, prompt in prompts.items():
        (whole,) = context.generate([prompt], PARAMS)
        assert [firsts[rid]] + early.get(rid, []) + late.get(rid, []) == whole.output_ids
    assert not generation.has_unfinished() and generation.pool.num_used == 0
    for kv in kvs.values():
        context.pool.free(kv.src)
    assert context.pool.num_used == 0


def test_a_failed_fetch_ends_its_request_alone_and_frees_its_blocks(engines):
    context, generation = engines
    first, broken = handed_off(engines, "broken", [5, 6, 7, 8, 9])
    generation.add_prefilled("broken", [5, 6, 7, 8, 9], first, PARAMS, broken)
    first_ok, ok = handed_off(engines, "ok", [11, 12, 13])
    generation.add_prefilled("ok", [11, 12, 13], first_ok, PARAMS, ok)
    ok.outcome = TransferStats(3, 0.0)
    tokens = run(generation, 1)
    ok_blocks = len(generation.scheduler.find("ok").block_table.block_ids)
    assert generation.pool.num_used > ok_blocks             # both hold their reservations
    broken.outcome = RuntimeError("the context server went away")
    tokens["ok"] += run(generation, 1)["ok"]
    (failed, ) = [a for a in generation.take_kv_arrivals() if a.error is not None]
    assert failed.request_id == "broken" and "went away" in str(failed.error)
    assert "broken" not in generation.scheduler and generation.pool.num_used == ok_blocks
    tokens["ok"] += run(generation, 8)["ok"]
    (whole,) = context.generate([[11, 12, 13]], PARAMS)
    assert [first_ok] + tokens["ok"] == whole.output_ids and "broken" not in tokens
    assert generation.pool.num_used == 0 and not generation.has_unfinished()


def test_an_abort_during_a_fetch_frees_the_blocks_once_it_ends(engines):
    context, generation = engines
    first, kv = handed_off(engines, "gone", [5, 6, 7])
    generation.add_prefilled("gone", [5, 6, 7], first, PARAMS, kv)
    run(generation, 1)
    held = generation.pool.num_used
    assert held > 0 and generation.abort("gone") and "gone" not in generation.scheduler
    run(generation, 2)
    assert generation.pool.num_used == held                 # the fetch may still write them
    kv.outcome = TransferStats(4, 0.0)
    run(generation, 1)
    assert generation.pool.num_used == 0 and not generation.has_unfinished()
    assert generation.take_kv_arrivals() == []             # nobody waits for it any more


def test_a_fetch_that_copies_inside_start_counts_its_step_as_blocked(engines):
    """What ``disagg_decode_steps_blocked_by_transfer_total`` counts: a transport that copies
    on the caller's thread (as the connectors did before the fetch thread)."""
    context, generation = engines

    class CopiesInStart(ManualKV):
        def start(self, block_ids, cached_blocks=0):
            time.sleep(0.02)                     # the copy, on the decode thread
            self.outcome = TransferStats(5, 0.0)
            return super().start(block_ids)

    first, kv = handed_off(engines, "r", [5, 6, 7])
    generation.add_prefilled("r", [5, 6, 7], first,
                             PARAMS, CopiesInStart(*engines, kv.src, kv.num_tokens))
    run(generation, 1)
    assert generation.scheduler.steps_blocked_by_transfer == 1
    run_until(generation, lambda: not generation.has_unfinished())
    assert generation.scheduler.steps_blocked_by_transfer == 1   # later polls return at once
    assert generation.pool.num_used == 0


def test_kv_of_another_length_than_the_prompt_is_refused(engines):
    context, generation = engines
    first, kv = handed_off(engines, "r", [5, 6, 7])
    with pytest.raises(RequestError, match="prompt has 4 tokens but the KV to fetch holds 3"):
        generation.add_prefilled("r", [5, 6, 7, 8], first, PARAMS, kv)
    assert not generation.has_unfinished() and generation.pool.num_used == 0


# ---- the same, with the fetch on the connector's fetch thread (kv/connector.py) -------------

class ThreadedKV(ManualKV):
    """A RemoteKV whose copy runs on ``worker`` (as a connector's does) once ``gate`` is set;
    a fetch still gated at its deadline fails as a silent context host's READ does."""

    def __init__(self, worker: FetchWorker, gate: threading.Event, *args,
                 timeout_s: float = WAIT_S):
        super().__init__(*args)
        self.worker, self.gate, self.timeout_s = worker, gate, timeout_s
        self.ran = threading.Event()

    def start(self, block_ids, cached_blocks=0):
        return self.worker.submit(lambda deadline: self._copy(block_ids, deadline),
                                  self.timeout_s, "test fetch")

    def _copy(self, block_ids, deadline):
        self.ran.set()
        if not self.gate.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError("the context host went silent")
        ManualKV.start(self, block_ids)
        return TransferStats(nbytes=len(self.src), seconds=0.0)


def run_until(generation, done, limit_s: float = WAIT_S) -> dict[str, list[int]]:
    """Step (as the decode loop does) until ``done()``; the tokens made meanwhile."""
    tokens: dict[str, list[int]] = {}
    end = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < end, "the fetch thread never finished"
        for rid, more in run(generation, 1).items():
            tokens.setdefault(rid, []).extend(more)
        time.sleep(0.001)
    return tokens


@pytest.fixture
def worker():
    fetcher = FetchWorker("test")
    yield fetcher
    fetcher.close()


def threaded(engines, worker, gate, rid, prompt, **kwargs):
    first, manual = handed_off(engines, rid, prompt)
    return first, ThreadedKV(worker, gate, *engines, manual.src, manual.num_tokens, **kwargs)


def test_the_loop_decodes_while_a_fetch_blocks_on_its_thread(engines, worker):
    context, generation = engines
    gate, ready = threading.Event(), threading.Event()
    ready.set()
    prompts = {"slow": [5, 6, 7, 8, 9], "running": [11, 12, 13]}
    first, kvs = {}, {}
    first["running"], kvs["running"] = threaded(engines, worker, ready, "running",
                                                prompts["running"])
    generation.add_prefilled("running", prompts["running"], first["running"], PARAMS,
                             kvs["running"])
    tokens = run_until(generation, lambda: generation.scheduler.running)
    first["slow"], kvs["slow"] = threaded(engines, worker, gate, "slow", prompts["slow"])
    generation.add_prefilled("slow", prompts["slow"], first["slow"], PARAMS, kvs["slow"])
    waits = [run_until(generation, kvs["slow"].ran.is_set), run(generation, 3)]
    assert len(waits[1]["running"]) == 3 and "slow" not in waits[1]   # blocked; steps go on
    assert generation.scheduler.find("slow").status == "waiting_for_remote_kv"
    gate.set()
    waits.append(run_until(generation, lambda: not generation.has_unfinished()))
    for part in waits:
        for rid, more in part.items():
            tokens[rid] = tokens.get(rid, []) + more
    for rid, prompt in prompts.items():
        (whole,) = context.generate([prompt], PARAMS)
        assert [first[rid]] + tokens[rid] == whole.output_ids
    arrivals = {a.request_id: a for a in generation.take_kv_arrivals()}
    hidden = {rid: a.compute.hidden_seconds(a.result.in_flight_seconds)
              for rid, a in arrivals.items()}
    assert all(a.result.in_flight_seconds > 0 for a in arrivals.values())
    assert hidden["running"] == 0.0          # fetched while the instance was idle
    assert 0 < hidden["slow"] <= arrivals["slow"].result.in_flight_seconds   # 3+ steps ran
    assert generation.pool.num_used == 0


def test_a_fetch_past_its_deadline_fails_alone_and_frees_its_blocks(engines, worker):
    context, generation = engines
    silent, ready = threading.Event(), threading.Event()
    ready.set()
    first, dead = threaded(engines, worker, silent, "dead", [5, 6, 7, 8, 9], timeout_s=0.3)
    generation.add_prefilled("dead", [5, 6, 7, 8, 9], first, PARAMS, dead)
    run_until(generation, dead.ran.is_set)
    # queued behind the silent one with a deadline shorter than that wait: its clock
    # starts when it runs, so it still succeeds
    first_ok, ok = threaded(engines, worker, ready, "ok", [11, 12, 13], timeout_s=0.1)
    generation.add_prefilled("ok", [11, 12, 13], first_ok, PARAMS, ok)
    tokens = run_until(generation, lambda: not generation.has_unfinished())
    errors = {a.request_id: a.error for a in generation.take_kv_arrivals() if a.error}
    assert set(errors) == {"dead"} and "went silent" in str(errors["dead"])
    (whole,) = context.generate([[11, 12, 13]], PARAMS)
    assert [first_ok] + tokens["ok"] == whole.output_ids and set(tokens) == {"ok"}
    assert generation.pool.num_used == 0


def test_a_cancel_while_the_thread_fetches_frees_the_blocks_once_it_ends(engines, worker):
    context, generation = engines
    gate = threading.Event()
    first, kv = threaded(engines, worker, gate, "gone", [5, 6, 7])
    generation.add_prefilled("gone", [5, 6, 7], first, PARAMS, kv)
    run_until(generation, kv.ran.is_set)
    held = generation.pool.num_used
    assert held > 0 and generation.abort("gone") and "gone" not in generation.scheduler
    run(generation, 3)
    assert generation.pool.num_used == held                 # the thread may still write them
    gate.set()
    run_until(generation, lambda: not generation.has_unfinished())
    assert generation.pool.num_used == 0 and generation.take_kv_arrivals() == []


# ---- the part of a fetch's time in flight hidden behind compute (engine/scheduler.py) ------

STEP_S = 0.010


class FakeClock:
    """The scheduler's clock: moves only when a decode pass runs (``STEP_S`` each) or the
    test waits (``wait``)."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> None:
        self.now += seconds


def on_fake_clock(generation) -> FakeClock:
    """Every decode pass of ``generation`` takes ``STEP_S`` on a fake clock."""
    clock, decode = FakeClock(), generation.runner.decode
    generation.scheduler.clock = clock

    def timed_decode(*args):
        clock.wait(STEP_S)
        return decode(*args)

    generation.runner.decode = timed_decode
    return clock


def test_a_fetch_overlapping_decode_steps_reports_their_time_as_hidden(engines):
    context, generation = engines
    clock = on_fake_clock(generation)
    first, running = handed_off(engines, "running", [11, 12, 13])
    running.outcome = TransferStats(1, 0.0, in_flight_seconds=0.0)
    generation.add_prefilled("running", [11, 12, 13], first, PARAMS, running)
    run(generation, 2)
    first, slow = handed_off(engines, "slow", [5, 6, 7, 8, 9])
    generation.add_prefilled("slow", [5, 6, 7, 8, 9], first, PARAMS, slow)
    generation.take_kv_arrivals()
    assert len(run(generation, 3)["running"]) == 3          # 3 steps while slow's KV moves
    slow.outcome = TransferStats(1, 0.0, in_flight_seconds=2.5 * STEP_S)  # ended mid-step 3
    run(generation, 1)
    (arrival,) = generation.take_kv_arrivals()
    assert arrival.request_id == "slow"
    assert arrival.compute.began == pytest.approx(clock.now - 4 * STEP_S)  # before 3 + 1 steps
    assert arrival.compute.hidden_seconds(2.5 * STEP_S) == pytest.approx(2.5 * STEP_S)
    assert arrival.compute.hidden_seconds(10 * STEP_S) == pytest.approx(3 * STEP_S)
    run(generation, 10)
    assert not generation.has_unfinished() and generation.pool.num_used == 0


def test_a_fetch_on_an_idle_instance_hides_nothing(engines):
    context, generation = engines
    clock = on_fake_clock(generation)
    first, alone = handed_off(engines, "alone", [5, 6, 7, 8, 9])
    generation.add_prefilled("alone", [5, 6, 7, 8, 9], first, PARAMS, alone)
    for _ in range(3):
        run(generation, 1)                      # nothing to compute: the loop waits
        clock.wait(STEP_S)
    alone.outcome = TransferStats(1, 0.0, in_flight_seconds=3 * STEP_S)
    run(generation, 1)
    (arrival,) = generation.take_kv_arrivals()
    assert arrival.compute.hidden_seconds(3 * STEP_S) == 0.0


def test_the_hidden_part_never_exceeds_the_time_in_flight():
    from triton_disagg.engine.scheduler import ComputeDuringFetch
    compute = ComputeDuringFetch(began=10.0)
    compute.add(9.0, 10.5)                      # a pass that began before the fetch
    compute.add(10.6, 11.0)
    assert compute.total == pytest.approx(0.9)
    assert compute.hidden_seconds(0.8) == pytest.approx(0.7)    # ended inside the last pass
    assert compute.hidden_seconds(0.55) == pytest.approx(0.5)   # ended between the passes
    assert compute.hidden_seconds(0.3) == pytest.approx(0.3)    # clocks a hair apart: capped
    assert compute.hidden_seconds(5.0) == pytest.approx(0.9)

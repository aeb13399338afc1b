"""KV taken as a sequence grows, and preemption with recompute (``MAX_UTILIZATION``, the
engine scheduler's default capacity policy), against Hugging Face on a tiny checkpoint.

Pools here hold one request's whole ``prompt + max_tokens`` but not two: both are admitted
(each takes its prompt and a block of room), decode until the pool runs out, and then the
newest is preempted, recomputed once blocks are free and finished with the tokens of a run
on a big pool (HF's greedy ones), each token sent once; no block is left in use at the end.
``GUARANTEED_NO_EVICT`` keeps TensorRT-LLM's old behaviour: the second request waits.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest

from copied_kv import CopiedKV
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import Runtime
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.engine.scheduler import CapacityPolicy
from triton_disagg.kv.handle import TransferStats

BLOCK = 4                   # tokens per block: sequences span many blocks
MAX_TOKENS = 40
PROMPTS = ([5, 17, 23, 9, 31], [7, 3, 40, 12, 8, 21, 30])
# One request needs blocks_for(7 + 40 - 1) = 12 blocks for its life; 18 hold one, not two.
SMALL_POOL = 18


@pytest.fixture(scope="module")
def engine_dirs(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    from triton_disagg.builders.build import build_engine

    root = tmp_path_factory.mktemp("preempt")
    for family in ("llama", "gpt2"):
        build_engine(tiny_checkpoints[family], root / family, tokens_per_block=BLOCK,
                     max_batch_size=4)
    return {family: root / family for family in ("llama", "gpt2")}


@functools.lru_cache(maxsize=None)
def hf_greedy(checkpoint: Path, prompt: tuple[int, ...], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def step_until_preempted(engine: LLMEngine) -> None:
    """Step until the scheduler preempted a sequence; fails if every request ends first."""
    while engine.scheduler.preemptions == 0:
        assert engine.has_unfinished(), "no request was preempted"
        engine.step()


def run(engine: LLMEngine, params: SamplingParams, add=None) -> dict[str, list[int]]:
    """Step ``engine`` to the end; each request's tokens, checking that every token event
    comes once (none after its request's final one). ``add(engine)`` queues the requests
    (default: ``PROMPTS`` as "r0", "r1")."""
    if add is None:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
    else:
        add(engine)
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    while engine.has_unfinished():
        for event in engine.step():
            assert event.request_id not in finished
            tokens.setdefault(event.request_id, []).append(event.tokens[0])
            if event.final:
                finished.add(event.request_id)
    assert finished == set(tokens)
    assert engine.pool.num_used == 0
    return tokens


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_small_pool_admits_both_requests_and_preempts_the_newest(engine_dirs, prefix_caching):
    engine = LLMEngine(engine_dirs["llama"], num_blocks=SMALL_POOL,
                       prefix_caching=prefix_caching)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()                                  # one prefill of both
    assert [s.request_id for s in engine.scheduler.running] == ["r0", "r1"]
    oldest, newest = engine.scheduler.running
    step_until_preempted(engine)
    assert newest.preemptions == 1 and newest.block_table.block_ids == []
    assert list(engine.scheduler.waiting) == [newest] and oldest.preemptions == 0
    assert engine.scheduler.running == [oldest]


@pytest.mark.parametrize("family, runtime", [("llama", "numpy"), ("llama", "torch"),
                                             ("gpt2", "numpy")])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_request_finishes_with_hf_greedy_tokens(engine_dirs, tiny_checkpoints,
                                                          family, runtime, prefix_caching):
    small = LLMEngine(engine_dirs[family], num_blocks=SMALL_POOL, runtime=Runtime(runtime),
                      prefix_caching=prefix_caching)
    got = run(small, SamplingParams(max_tokens=MAX_TOKENS))
    assert small.scheduler.preemptions >= 1
    for i, prompt in enumerate(PROMPTS):
        assert got[f"r{i}"] == hf_greedy(tiny_checkpoints[family], tuple(prompt), MAX_TOKENS)


def test_seeded_sampling_is_the_same_with_preemption(engine_dirs):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_k=50, seed=11,
                            repetition_penalty=1.2)
    small = LLMEngine(engine_dirs["llama"], num_blocks=SMALL_POOL)
    got = run(small, params)
    assert small.scheduler.preemptions >= 1
    assert got == run(LLMEngine(engine_dirs["llama"]), params)


def test_a_preempted_request_whose_kv_stayed_cached_decodes_on_without_a_prefill(engine_dirs):
    """Preempted when its written KV fills whole blocks, with a pool that keeps them cached,
    a request takes them all back and decodes on: no prefill pass, the same tokens."""
    params = SamplingParams(max_tokens=MAX_TOKENS)
    expected = run(LLMEngine(engine_dirs["llama"]), params)["r0"]
    engine = LLMEngine(engine_dirs["llama"])
    engine.add_request("r0", PROMPTS[0], params)
    tokens = [e.tokens[0] for e in engine.step()]
    (seq,) = engine.scheduler.running
    while seq.block_table.num_tokens % BLOCK:
        tokens += [e.tokens[0] for e in engine.step()]
    engine.scheduler.preempt(seq)
    written = seq.num_tokens - 1
    prefills = []
    engine.runner.prefill = lambda *args: prefills.append(args)   # must not be called
    tokens += [e.tokens[0] for e in engine.step()]
    assert seq.num_cached_tokens == written and engine.scheduler.running == [seq]
    while engine.has_unfinished():
        tokens += [e.tokens[0] for e in engine.step()]
    assert tokens == expected and not prefills and seq.preemptions == 1
    assert engine.pool.num_used == 0


def test_guaranteed_no_evict_admits_one_and_never_preempts(engine_dirs):
    engine = LLMEngine(engine_dirs["llama"], num_blocks=SMALL_POOL,
                       capacity_policy=CapacityPolicy.GUARANTEED_NO_EVICT)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS))
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["r0"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["r1"]
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.preemptions == 0 and engine.pool.num_used == 0


def test_abort_of_a_preempted_request_frees_nothing_twice(engine_dirs):
    engine = LLMEngine(engine_dirs["llama"], num_blocks=SMALL_POOL)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS))
    step_until_preempted(engine)
    assert engine.admitted("r0") and not engine.admitted("r1")
    assert engine.abort("r1") and "r1" not in engine.scheduler
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("prefix_caching, prompt_logprobs", [(True, None), (False, None),
                                                             (True, 1)])
def test_preempted_disaggregated_request_is_recomputed_on_the_generation_side(
        engine_dirs, tiny_checkpoints, prefix_caching, prompt_logprobs):
    """The generation side received the prompt's KV from a context; preempted, it prefills
    prompt + its tokens so far itself (the handle is not fetched twice) and its stream goes
    on: first token from the context, then the rest, as HF's greedy run. A request that
    asked for its prompt's log-probs (echo + logprobs: the context made them) does not
    make them again in that recompute."""
    context = LLMEngine(engine_dirs["llama"])
    generation = LLMEngine(engine_dirs["llama"], num_blocks=SMALL_POOL,
                           prefix_caching=prefix_caching)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    results = context.prefill_only([(f"r{i}", p, params) for i, p in enumerate(PROMPTS)])
    kvs = [CopiedKV(context, generation, r) for r in results]

    def add(engine):
        for prompt, result, kv in zip(PROMPTS, results, kvs):
            engine.add_prefilled(result.request_id, prompt, result.token_id,
                                 replace(params, prompt_logprobs=prompt_logprobs), kv)

    got = run(generation, params, add)
    assert generation.scheduler.preemptions >= 1 and [kv.started for kv in kvs] == [1, 1]
    for i, (prompt, result) in enumerate(zip(PROMPTS, results)):
        assert [result.token_id] + got[f"r{i}"] == hf_greedy(tiny_checkpoints["llama"],
                                                             tuple(prompt), MAX_TOKENS)
    assert context.pool.num_used == 0


class InFlightKV:
    """A remote KV fetch in flight until its request is aborted (cancelled)."""

    num_tokens = len(PROMPTS[0])
    cancelled = False

    skips_cached = False           # fetches every block

    def start(self, block_ids, cached_blocks=0):
        return self

    def poll(self):
        return TransferStats(0, 0.0) if self.cancelled else None

    def cancel(self):
        self.cancelled = True


def test_a_preempted_request_waits_behind_those_holding_blocks(engine_dirs):
    """The waiting queue keeps those holding their blocks (here one fetching its KV) ahead
    of those without; a preempted request goes first among the latter, before later ones."""
    engine = LLMEngine(engine_dirs["llama"], num_blocks=SMALL_POOL)
    scheduler = engine.scheduler
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS))
    engine.step()                                          # r0, r1: 3 blocks each
    engine.add_prefilled("fetching", PROMPTS[0], 1, SamplingParams(max_tokens=4),
                         InFlightKV())
    engine.add_request("later", list(range(3, 43)), SamplingParams(max_tokens=4))
    engine.step()                                          # fetching: 3 blocks; later: none
    assert engine.admitted("fetching") and not engine.admitted("later")
    scheduler.preempt(scheduler.running[-1])
    assert [s.request_id for s in scheduler.waiting] == ["fetching", "r1", "later"]
    for request_id in ("fetching", "later"):
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_used == 0


def test_preemptions_reach_the_metric(engine_dirs):
    from triton_disagg.generation.decode_loop import DecodeAdmission

    class Metrics:
        def __init__(self):
            self.totals: list[int] = []

        def preemptions(self, total: int) -> None:
            self.totals.append(total)

        def __getattr__(self, name):                # the other gauges: not under test
            return lambda *args, **kwargs: None

    engine = LLMEngine(engine_dirs["llama"], num_blocks=SMALL_POOL)
    metrics = Metrics()
    side = DecodeAdmission(engine, None, metrics)
    run(engine, SamplingParams(max_tokens=MAX_TOKENS))
    side.report(0)
    assert metrics.totals == [engine.scheduler.preemptions] and metrics.totals[0] >= 1




def test_decode_loop_streams_a_preempted_request_with_no_gap_or_repeat(engine_dirs):
    """Through the generation decode loop and real ZeroMQ: each request's events, numbered
    0, 1, 2, ... without a gap, carry the tokens of a run on a big pool, each once."""
    import zmq

    from triton_disagg import token_wire
    from triton_disagg.generation.decode_loop import DecodeAdmission, DecodeLoop
    from triton_disagg.token_wire import TokenOutbox
    from triton_disagg.engine.sequence import EngineRequest
    from triton_disagg.zmq_endpoints import bind

    params = SamplingParams(max_tokens=MAX_TOKENS)
    expected = run(LLMEngine(engine_dirs["llama"]), params)
    engine = LLMEngine(engine_dirs["llama"], num_blocks=SMALL_POOL)
    context = zmq.Context.instance()
    sock = context.socket(zmq.PULL)
    endpoint = bind(sock, None, "tokens")
    side = DecodeAdmission(engine, None)
    loop = DecodeLoop(engine, TokenOutbox(context), side)
    for i, prompt in enumerate(PROMPTS):
        loop.submit(f"r{i}", EngineRequest(prompt, params, True),
                    token_wire.with_key(endpoint.address, "k"))
    tokens: dict[str, list[int]] = {rid: [] for rid in expected}
    numbers: dict[str, list[int]] = {rid: [] for rid in expected}
    finals = 0
    try:
        while finals < len(PROMPTS):
            assert sock.poll(60_000), tokens
            for event in token_wire.decode_events(sock.recv()):
                assert event.error is None, event.error
                tokens[event.request_id] += event.tokens
                numbers[event.request_id].append(event.seq)
                finals += event.final
    finally:
        loop.close()
        sock.close(linger=0)
        endpoint.release()
    assert tokens == expected
    assert all(n == list(range(len(n))) for n in numbers.values())
    assert engine.scheduler.preemptions >= 1 and engine.pool.num_used == 0

GUIDE = """\
model: {engine: engines/demo}
kv_cache: {strategy: direct_transfer, max_size: 2GB%s}
"""


def test_capacity_policy_is_read_from_the_config_and_reaches_the_engine(tmp_path, tiny_engines):
    from dataclasses import replace

    from config_files import assert_one_line_error, config_writer
    from triton_disagg.config.disagg import load_config
    from triton_disagg.config.settings import from_json, to_json
    from triton_disagg.engine.capacity import make_engine
    from triton_disagg.triton.render import settings

    write = config_writer(tmp_path)
    assert load_config(write(GUIDE % "")).kv_cache.capacity_scheduler_policy == "MAX_UTILIZATION"
    cfg = load_config(write(GUIDE % ", capacity_scheduler_policy: GUARANTEED_NO_EVICT"))
    carried = from_json("generation", to_json(settings("generation", "disaggregated", cfg)))
    engine = make_engine(replace(carried, engine=str(tiny_engines["llama"]),
                                 kv_max_size=2**24), "generation")
    assert engine.scheduler.policy is CapacityPolicy.GUARANTEED_NO_EVICT
    assert_one_line_error(write(GUIDE % ", capacity_scheduler_policy: fifo"),
                          ["kv_cache.capacity_scheduler_policy: 'fifo' is not one of "
                           "MAX_UTILIZATION, GUARANTEED_NO_EVICT"])

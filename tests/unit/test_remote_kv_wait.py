"""The scheduler's waiting-for-remote-KV state, with fetches the test completes by hand:
a request whose fetch has not completed holds its blocks but does not decode while the
others do; it joins the batch when its fetch polls done; a failed fetch ends that request
alone and frees its blocks; an abort during a fetch frees the blocks once it ends."""

from __future__ import annotations

import pytest

from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.errors import RequestError
from triton_disagg.engine.spec import KVLayout

LAYOUT = KVLayout(tokens_per_block=4, dtype="float32")
PARAMS = SamplingParams(max_tokens=6)


class ManualKV:
    """A RemoteKV whose fetch copies the context's blocks at start but completes only when
    the test sets ``outcome`` (a result, or an exception to raise)."""

    def __init__(self, context: LLMEngine, generation: LLMEngine, block_ids: list[int],
                 num_tokens: int):
        self.context, self.generation = context, generation
        self.src, self.num_tokens = block_ids, num_tokens
        self.outcome = None

    def start(self, block_ids):
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
            tokens.setdefault(event.request_id, []).append(event.token_id)
    return tokens


def test_a_request_decodes_only_once_its_kv_has_arrived(engines):
    context, generation = engines
    prompts = {"slow": [5, 6, 7, 8, 9], "fast": [11, 12, 13]}
    kvs, firsts = {}, {}
    for rid, prompt in prompts.items():
        firsts[rid], kvs[rid] = handed_off(engines, rid, prompt)
        generation.add_prefilled(rid, prompt, firsts[rid], PARAMS, kvs[rid])
    kvs["fast"].outcome = "fast stats"
    early = run(generation, 3)
    slow = generation.scheduler.find("slow")
    assert "slow" not in early and len(early["fast"]) == 3      # the others keep decoding
    assert slow.status == "waiting_for_remote_kv" and generation.admitted("slow")
    assert len(slow.block_table.block_ids) == generation.pool.geometry.blocks_for(5 + 6 - 1)
    assert [(a.request_id, a.result) for a in generation.take_kv_arrivals()] == \
        [("fast", "fast stats")]
    kvs["slow"].outcome = "slow stats"
    late = run(generation, 8)
    assert [(a.request_id, a.result) for a in generation.take_kv_arrivals()] == \
        [("slow", "slow stats")]
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
    ok.outcome = "ok stats"
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
    kv.outcome = "late stats"
    run(generation, 1)
    assert generation.pool.num_used == 0 and not generation.has_unfinished()
    assert generation.take_kv_arrivals() == []             # nobody waits for it any more


def test_kv_of_another_length_than_the_prompt_is_refused(engines):
    context, generation = engines
    first, kv = handed_off(engines, "r", [5, 6, 7])
    with pytest.raises(RequestError, match="prompt has 4 tokens but the KV to fetch holds 3"):
        generation.add_prefilled("r", [5, 6, 7, 8], first, PARAMS, kv)
    assert not generation.has_unfinished() and generation.pool.num_used == 0

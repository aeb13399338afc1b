"""Disaggregated equals aggregated: a prompt prefilled by one engine (``prefill_only``),
its KV copied and converted into another engine's blocks (the handoff, another block size
too) and decoded there (``add_prefilled``) gives the tokens of one engine doing both."""

import pytest

from copied_kv import CopiedKV
from hf_reference import engines, prompts_for, runtime  # noqa: F401
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.engine.spec import KVLayout


@pytest.mark.parametrize("family, generation_block", [("llama", 4), ("gpt2", 4), ("llama", 8)])
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=20),
                                    SamplingParams(max_tokens=20, temperature=0.9, top_k=50,
                                                   seed=11, repetition_penalty=1.2)])
def test_prefill_only_then_add_prefilled_equals_aggregated(family, generation_block, params,
                                                           runtime, engines):
    context = LLMEngine(engines[family], runtime=runtime)
    generation = LLMEngine(engines[family], kv_layout=KVLayout(tokens_per_block=generation_block),
                           runtime=runtime)
    prompts = prompts_for(context)
    expected = [s.output_ids for s in LLMEngine(engines[family]).generate(prompts, params)]
    results = context.prefill_only([(f"r{i}", p, params) for i, p in enumerate(prompts)])
    for prompt, result in zip(prompts, results):
        assert result.num_tokens == len(prompt) and result.finish_reason is None
        generation.add_prefilled(result.request_id, prompt, result.token_id, params,
                                 CopiedKV(context, generation, result))
    got = {r.request_id: [r.token_id] for r in results}
    while generation.has_unfinished():
        for event in generation.step():
            got[event.request_id].append(event.tokens[0])
    assert [got[r.request_id] for r in results] == expected
    assert context.pool.num_used == 0
    assert generation.pool.num_used == 0

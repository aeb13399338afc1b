"""The engine's model runners (numpy, torch CPU) against Hugging Face transformers on the
tiny checkpoints of every family: prefill logits, greedy and batched generation, a resumed
prompt, seeded sampling, stops, float16, prompt log-probs (the reference and the engines:
tests/support/hf_reference.py; with a cached prefix: test_prefix_cache_vs_hf.py)."""

import numpy as np
import pytest

from hf_reference import (FAMILIES, MAX_TOKENS, engines, hf_greedy, hf_logits,  # noqa: F401
                          prompts_for, runtime)
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import Runtime
from triton_disagg.engine.sampling import SamplingParams


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_of_every_position_match_hf(family, runtime, engines, tiny_checkpoints):
    engine = LLMEngine(engines[family], runtime=runtime)
    prompts = prompts_for(engine)
    tables = [engine.pool.allocate(engine.pool.geometry.blocks_for(len(p))) for p in prompts]
    ours = engine.runner.prefill_all_logits(list(zip(prompts, tables)))
    for prompt, logits in zip(prompts, ours):
        np.testing.assert_allclose(logits, hf_logits(tiny_checkpoints[family], prompt),
                                   atol=1e-3, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_alone_matches_hf_generate(family, runtime, engines, tiny_checkpoints):
    engine = LLMEngine(engines[family], runtime=runtime)
    for prompt, n in zip(prompts_for(engine), MAX_TOKENS):
        (seq,) = engine.generate([prompt], SamplingParams(max_tokens=n))
        assert seq.output_ids == hf_greedy(tiny_checkpoints[family], tuple(prompt), n)
        assert seq.finish_reason == "length"
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_with_continuous_batching_matches_hf(family, runtime, engines,
                                                         tiny_checkpoints):
    # 24 blocks of 4 tokens: not every request's reservation fits at once, so some wait.
    engine = LLMEngine(engines[family], num_blocks=24, runtime=runtime)
    prompts = prompts_for(engine) + prompts_for(engine, seed=1)
    budgets = list(MAX_TOKENS) * 2
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finished, waited = set(), False
    for i in range(3):
        engine.add_request(str(i), prompts[i], SamplingParams(max_tokens=budgets[i]))
    steps = 0
    while engine.has_unfinished() or steps < 4:
        if steps == 4:
            for i in range(3, len(prompts)):
                engine.add_request(str(i), prompts[i], SamplingParams(max_tokens=budgets[i]))
        waited |= bool(engine.scheduler.waiting and engine.scheduler.running)
        for event in engine.step():
            assert event.request_id not in finished
            tokens[event.request_id].append(event.tokens[0])
            if event.final:
                finished.add(event.request_id)
        steps += 1
    assert waited and finished == set(tokens)
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == hf_greedy(tiny_checkpoints[family], tuple(prompt), budgets[i])
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_resumed_prompt_continues_like_hf_and_runtimes_agree(family, engines, tiny_checkpoints):
    """A resumed request (migrated) re-prefills prompt + the tokens generated so far, then
    decodes on: its tokens equal HF's uninterrupted greedy run, on both runners."""
    tokens = {}
    for name in ("numpy", "torch"):
        engine = LLMEngine(engines[family], runtime=Runtime(name))
        prompt = prompts_for(engine)[2]
        ref = hf_greedy(tiny_checkpoints[family], tuple(prompt), 30)
        (seq,) = engine.generate([prompt + ref[:11]], SamplingParams(max_tokens=19))
        assert ref[:11] + seq.output_ids == ref
        assert engine.pool.num_used == 0
        tokens[name] = seq.output_ids
    assert tokens["torch"] == tokens["numpy"]


def test_seeded_sampling_does_not_depend_on_batch_composition(engines):
    engine = LLMEngine(engines["llama"])
    prompts = prompts_for(engine)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=5)
    alone = engine.generate([prompts[2]], params)[0].output_ids
    batched = engine.generate(prompts, params)[2].output_ids
    assert alone == batched
    other_seed = engine.generate([prompts[2]], SamplingParams(max_tokens=16, temperature=1.0,
                                                             top_p=0.9, seed=6))[0].output_ids
    assert other_seed != alone


def test_end_id_stops_and_is_included(engines, tiny_checkpoints):
    engine = LLMEngine(engines["qwen2"])
    prompt = prompts_for(engine)[1]
    ref = hf_greedy(tiny_checkpoints["qwen2"], tuple(prompt), 40)
    end = ref[6]
    (seq,) = engine.generate([prompt], SamplingParams(max_tokens=40, end_id=end))
    assert seq.finish_reason == "stop" and seq.output_ids == ref[:ref.index(end) + 1]
    word = ref[3:5]
    stop = next(j for j in range(2, 41) if ref[j - 2:j] == word)
    (seq,) = engine.generate([prompt], SamplingParams(max_tokens=40, stop_words=[word]))
    assert seq.finish_reason == "stop_word" and seq.output_ids == ref[:stop]


def test_float16_engine_and_kv_stay_close_to_hf(runtime, tiny_checkpoints, tmp_path):
    from triton_disagg.builders.build import build_engine

    build_engine(tiny_checkpoints["llama"], tmp_path / "fp16", dtype="float16",
                 kv_dtype="float16", tokens_per_block=4)
    engine = LLMEngine(tmp_path / "fp16", runtime=runtime)
    assert engine.pool.array.dtype == np.float16
    prompt = prompts_for(engine)[3]
    blocks = engine.pool.allocate(engine.pool.geometry.blocks_for(len(prompt)))
    engine.runner.prefill([(prompt[:-1], blocks)])
    logits = engine.runner.decode([prompt[-1]], [len(prompt) - 1], [blocks])
    np.testing.assert_allclose(logits[0], hf_logits(tiny_checkpoints["llama"], prompt)[-1],
                               atol=2e-2, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_prompt_logprobs_match_hf_log_softmax(family, runtime, engines, tiny_checkpoints):
    """Prompt log-probs and their top alternatives are HF's log_softmax of each position's
    logits, for a prompt batched with one that does not ask; a prompt whose prefix is cached
    still computes every position (it does not read the cache)."""
    engine = LLMEngine(engines[family], runtime=runtime, prefix_caching=True)
    prompt, other = prompts_for(engine)[3], prompts_for(engine, seed=1)[2]
    engine.generate([prompt], SamplingParams(max_tokens=1))     # its blocks are now cached
    asks = SamplingParams(max_tokens=1, prompt_logprobs=3)
    seqs = engine.generate([other, prompt], [SamplingParams(max_tokens=1), asks])
    assert seqs[0].prompt_logprobs is None and seqs[1].num_cached_tokens == 0
    got = seqs[1].prompt_logprobs
    import torch

    hf = torch.log_softmax(torch.from_numpy(hf_logits(tiny_checkpoints[family], prompt)[:-1]),
                           dim=-1).numpy()                        # [n-1, V]
    np.testing.assert_allclose(got.chosen, hf[np.arange(len(hf)), prompt[1:]], atol=1e-3)
    np.testing.assert_array_equal(got.top_ids[:, 0], hf.argmax(1))
    np.testing.assert_allclose(got.top, -np.sort(-hf, axis=1)[:, :3], atol=1e-3)
    assert got.chosen.shape == (len(prompt) - 1,) and got.top_ids.shape == (len(prompt) - 1, 3)

"""The engine's model runners (numpy, torch CPU) against Hugging Face transformers on the
tiny checkpoints of every family.

Engines here are rebuilt from the shared ``tiny_checkpoints`` with 4 tokens per block
(so sequences span several blocks) and max_batch_size 4 (so requests queue). Tests that
check the math take the ``runtime`` fixture and run once per runner; control-logic tests
run on the numpy runner only (the logic is the same copy for both).
"""

import functools
from pathlib import Path

import numpy as np
import pytest

from triton_disagg.kv.connector import Transfer
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.errors import RequestError
from triton_disagg.engine.runtime import Runtime
from triton_disagg.engine.spec import KVLayout
from triton_disagg.engine.block_pool import KVCacheFullError

FAMILIES = ["llama", "llama3", "qwen2", "mistral", "gpt2"]
PROMPT_LENGTHS = (1, 5, 12, 23)
MAX_TOKENS = (33, 40, 32, 36)


@pytest.fixture(params=["numpy", "torch"])
def runtime(request) -> Runtime:
    return Runtime(request.param, "cpu", "float32")


@pytest.fixture(scope="module")
def engines(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    from triton_disagg.builders.build import build_engine

    root = tmp_path_factory.mktemp("block4")
    for family, checkpoint in tiny_checkpoints.items():
        build_engine(checkpoint, root / family, tokens_per_block=4, max_batch_size=4)
    return {family: root / family for family in tiny_checkpoints}


@functools.lru_cache(maxsize=None)
def hf_model(checkpoint: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def hf_greedy(checkpoint: Path, prompt: tuple[int, ...], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = hf_model(checkpoint).generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
            pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(checkpoint: Path, prompt) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(checkpoint)(torch.tensor([list(prompt)])).logits[0].numpy()


def prompts_for(engine: LLMEngine, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, engine.spec.shape.vocab_size, n).tolist() for n in PROMPT_LENGTHS]


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
            tokens[event.request_id].append(event.token_id)
            if event.finished:
                finished.add(event.request_id)
        steps += 1
    assert waited and finished == set(tokens)
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == hf_greedy(tiny_checkpoints[family], tuple(prompt), budgets[i])
    assert engine.pool.num_used == 0


class CopiedKV(Transfer):
    """A prefill's KV as the generation engine fetches it (the KV handoff): copied and
    converted into the blocks the scheduler reserved when it starts, then the context's
    blocks are freed; done at once."""

    def __init__(self, context: LLMEngine, generation: LLMEngine, result):
        self.context, self.generation, self.result = context, generation, result
        self.num_tokens = result.num_tokens

    skips_cached = False           # copies every block

    def start(self, block_ids, cached_blocks=0):
        from triton_disagg.kv.layout import write_blocks

        dst = block_ids[:self.generation.pool.geometry.blocks_for(self.num_tokens)]
        write_blocks(self.context.pool.read_blocks(self.result.block_ids), self.num_tokens,
                     self.generation.pool.array, dst)
        self.context.pool.free(self.result.block_ids)
        return self

    def poll(self):
        return self.num_tokens


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
            got[event.request_id].append(event.token_id)
    assert [got[r.request_id] for r in results] == expected
    assert context.pool.num_used == 0
    assert generation.pool.num_used == 0


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


def test_invalid_requests_raise_clear_errors_and_abort_frees(engines):
    engine = LLMEngine(engines["gpt2"], num_blocks=8)
    vocab, limit = engine.spec.shape.vocab_size, engine.runner.max_context
    params = SamplingParams(max_tokens=4)
    cases = [([], "empty"), ([1, vocab], "outside the vocabulary"), ([1.5], "integers"),
             ([1] * limit, "shorten it"), ([1] * 40, "lower max_tokens"),
             ([vocab] * limit, "shorten it")]     # the length is checked before the ids
    for prompt, message in cases:
        with pytest.raises(RequestError, match=message):
            engine.add_request("bad", prompt, params)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request("bad", [1], SamplingParams(stop_words=[[vocab]]))
    engine.add_request("a", [1, 2, 3], params)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("a", [1], params)
    engine.step()
    assert engine.pool.num_used > 0 and engine.abort("a") and not engine.abort("a")
    assert engine.pool.num_used == 0 and not engine.has_unfinished()
    held = engine.pool.allocate(6)
    with pytest.raises(KVCacheFullError):
        engine.prefill_only([("p", [1] * 12, params)])
    assert engine.pool.num_used == 6
    engine.pool.free(held)
    with pytest.raises(RequestError, match="raise kv_cache.max_size"):
        engine.prefill_only([("p", [1] * 12, params)] * 3)
    (done,) = engine.prefill_only([("p", [1, 2], SamplingParams(max_tokens=1))])
    assert done.finish_reason == "length" and done.block_ids == [] and engine.pool.num_used == 0
    with pytest.raises(RequestError, match="already finished"):
        engine.add_prefilled("p", [1, 2], 5, SamplingParams(max_tokens=1), TwoTokensOfKV)
    # The prompt has 2 tokens; KV of any other length is refused.
    for prompt in ([1], [1, 2, 3]):
        with pytest.raises(RequestError, match="the KV to fetch holds 2"):
            engine.add_prefilled("p", prompt, 5, params, TwoTokensOfKV)
    assert engine.pool.num_used == 0 and not engine.has_unfinished()


class TwoTokensOfKV:
    """A remote prompt KV of 2 tokens that is never fetched (its request is refused)."""

    num_tokens = 2


# ---- prefix caching: prefill after a cached prefix, output equal to the uncached run ----

PREFIX_LEN = 12          # 3 blocks of 4 tokens shared by the prompts below


def shared_prefix_prompts(engine: LLMEngine) -> tuple[list[int], list[int]]:
    """Two prompts of 19 and 17 tokens that share their first PREFIX_LEN tokens."""
    rng = np.random.default_rng(7)
    vocab = engine.spec.shape.vocab_size
    prefix = rng.integers(3, vocab, PREFIX_LEN).tolist()
    return prefix + rng.integers(3, vocab, 7).tolist(), prefix + rng.integers(3, vocab, 5).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_after_a_cached_prefix_matches_hf_logits(family, runtime, engines,
                                                         tiny_checkpoints):
    """The suffix attends to the prefix's KV in the pool at the right positions: its logits
    are HF's at those positions, alone and batched with a fresh prompt (padding, masks)."""
    engine = LLMEngine(engines[family], runtime=runtime)
    prompt, fresh = prompts_for(engine)[3], prompts_for(engine)[2]
    blocks = engine.pool.allocate(engine.pool.geometry.blocks_for(len(prompt)))
    engine.runner.prefill([(prompt[:8], blocks[:2])])
    expected = hf_logits(tiny_checkpoints[family], prompt)
    (alone,) = engine.runner.prefill_all_logits([(prompt, blocks, 8)])
    np.testing.assert_allclose(alone, expected[8:], atol=1e-3, rtol=0)
    fresh_blocks = engine.pool.allocate(engine.pool.geometry.blocks_for(len(fresh)))
    batched = engine.runner.prefill([(fresh, fresh_blocks), (prompt, blocks, 20)])
    np.testing.assert_allclose(batched[1], expected[-1], atol=1e-3, rtol=0)
    np.testing.assert_allclose(batched[0], hf_logits(tiny_checkpoints[family], fresh)[-1],
                               atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="its last token is always computed"):
        engine.runner.prefill([(prompt, blocks, len(prompt))])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_the_prefix_cache_equals_hf(family, runtime, engines, tiny_checkpoints):
    """A second prompt sharing 3 blocks, a wholly cached prompt, the next turn of a
    conversation (its generated blocks cached too) and a salted request: each one's greedy
    tokens equal HF's; the salt never hits another salt's blocks."""
    engine = LLMEngine(engines[family], runtime=runtime)
    first, second = shared_prefix_prompts(engine)
    ckpt = tiny_checkpoints[family]

    def run(prompt, salt=None, n=10):
        (seq,) = engine.generate([prompt], SamplingParams(max_tokens=n, cache_salt=salt))
        assert seq.output_ids == hf_greedy(ckpt, tuple(prompt), n)
        return seq

    assert run(first).num_cached_tokens == 0
    assert run(second).num_cached_tokens == PREFIX_LEN
    assert run(first).num_cached_tokens == 16                 # wholly cached: 19 = 4 blocks + 3
    turn = first + hf_greedy(ckpt, tuple(first), 10) + [5, 6, 7]
    assert run(turn, n=6).num_cached_tokens == 28             # prompt + generated blocks
    assert run(second, salt="tenant-1").num_cached_tokens == 0
    assert run(second, salt="tenant-1").num_cached_tokens == 16
    assert run(second, salt="tenant-2").num_cached_tokens == 0
    cache = engine.pool.cache
    assert cache.hit_tokens == PREFIX_LEN + 16 + 28 + 16
    assert cache.query_tokens == 2 * len(first) + len(turn) + 4 * len(second)
    assert engine.pool.num_used == 0 and engine.pool.num_cached > 0


def test_cached_prefix_is_shared_by_a_running_sequence_and_output_unchanged(engines,
                                                                             tiny_checkpoints):
    """A request admitted while another still decodes takes the blocks that one holds
    (reference count 2) and both decode as HF does; without the cache, the same tokens."""
    outputs = {}
    for caching in (True, False):
        engine = LLMEngine(engines["llama"], prefix_caching=caching)
        first, second = shared_prefix_prompts(engine)
        engine.add_request("a", first, SamplingParams(max_tokens=12))
        tokens = {"a": [], "b": []}
        for _ in range(3):
            for e in engine.step():
                tokens[e.request_id].append(e.token_id)
        engine.add_request("b", second, SamplingParams(max_tokens=12))
        shared = list(engine.scheduler.find("a").block_table.block_ids[:3])
        for e in engine.step():                              # b's prefill
            tokens[e.request_id].append(e.token_id)
        b = engine.scheduler.find("b")
        assert b.num_cached_tokens == (PREFIX_LEN if caching else 0)
        if caching:
            assert b.block_table.block_ids[:3] == shared
            assert [engine.pool.refcount(x) for x in shared] == [2, 2, 2]
        while engine.has_unfinished():
            for e in engine.step():
                tokens[e.request_id].append(e.token_id)
        assert tokens["a"] == hf_greedy(tiny_checkpoints["llama"], tuple(first), 12)
        assert tokens["b"] == hf_greedy(tiny_checkpoints["llama"], tuple(second), 12)
        assert engine.pool.num_used == 0 and (engine.pool.num_cached > 0) == caching
        outputs[caching] = tokens
    assert outputs[True] == outputs[False]


def test_context_prefill_hands_off_the_full_block_list_and_never_frees_a_shared_block(
        engines, tiny_checkpoints):
    """The context side: a hit skips the prefix's prefill; the handle's blocks are the
    whole prompt's (the shared ones first); a shared block stays held and unchanged while
    another handle holds it, however much the pool is reused meanwhile."""
    engine = LLMEngine(engines["llama"], num_blocks=12)
    first, second = shared_prefix_prompts(engine)
    params = SamplingParams(max_tokens=4)
    (a,) = engine.prefill_only([("a", first, params)])
    (b,) = engine.prefill_only([("b", second, params)])
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, PREFIX_LEN)
    assert b.num_tokens == len(second) and len(b.block_ids) == 5
    assert b.block_ids[:3] == a.block_ids[:3] and len(set(a.block_ids + b.block_ids)) == 7
    assert b.token_id == hf_greedy(tiny_checkpoints["llama"], tuple(second), 1)[0]
    shared = b.block_ids[:3]
    kv = engine.pool.read_blocks(shared)
    engine.pool.free(a.block_ids)                            # a's transfer is done
    assert [engine.pool.refcount(x) for x in shared] == [1, 1, 1]
    rng = np.random.default_rng(3)
    for i in range(6):                                      # fill and evict the rest
        prompt = rng.integers(3, engine.spec.shape.vocab_size, 21).tolist()
        (other,) = engine.prefill_only([(f"o{i}", prompt, params)])
        assert not set(other.block_ids) & set(shared)
        engine.pool.free(other.block_ids)
    assert engine.pool.cache.evicted_blocks > 0
    np.testing.assert_array_equal(engine.pool.read_blocks(shared), kv)
    engine.pool.free(b.block_ids)
    assert engine.pool.num_used == 0


def test_a_pool_too_small_for_the_working_set_evicts_and_refuses_nothing(engines):
    """More distinct prefixes than the pool holds, cycled: with the cache every request is
    served (evicting), with the tokens of the cacheless run."""
    outputs = {}
    for caching in (True, False):
        engine = LLMEngine(engines["gpt2"], num_blocks=10, prefix_caching=caching)
        rng = np.random.default_rng(5)
        prompts = [rng.integers(3, engine.spec.shape.vocab_size, 15).tolist() for _ in range(4)]
        order = [prompts[i % 4] for i in range(10)]
        seqs = engine.generate(order, SamplingParams(max_tokens=8))
        outputs[caching] = [s.output_ids for s in seqs]
        assert engine.pool.num_used == 0
        if caching:
            assert engine.pool.cache.evicted_blocks > 0
    assert outputs[True] == outputs[False]


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

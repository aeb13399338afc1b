"""Prefix caching against Hugging Face: prefill after a cached prefix, output equal to the
uncached run (both runners); blocks shared with a running sequence or another handle are
held and never freed or overwritten under them; a pool too small for the working set
evicts and refuses nothing."""

import numpy as np
import pytest

from hf_reference import (FAMILIES, engines, hf_greedy, hf_logits, prompts_for,  # noqa: F401
                          runtime)
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.sampling import SamplingParams

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
def test_prefill_attention_in_row_chunks_matches_hf_logits(family, engines, tiny_checkpoints,
                                                           monkeypatch):
    """A prompt's attention goes in chunks of rows, each against only the keys it sees:
    with chunks of a few rows (boundaries inside and across blocks) every position's logits
    are still HF's, cold and after a cached prefix."""
    from triton_disagg.engine import model

    monkeypatch.setattr(model, "ATTENTION_CHUNK_BYTES", 1500)   # ~3 rows of a short prompt
    engine = LLMEngine(engines[family])
    prompt = prompts_for(engine)[3]
    expected = hf_logits(tiny_checkpoints[family], prompt)
    blocks = engine.pool.allocate(engine.pool.geometry.blocks_for(len(prompt)))
    (cold,) = engine.runner.prefill_all_logits([(prompt, blocks, 0)])
    np.testing.assert_allclose(cold, expected, atol=1e-3, rtol=0)
    (after,) = engine.runner.prefill_all_logits([(prompt, blocks, 8)])
    np.testing.assert_allclose(after, expected[8:], atol=1e-3, rtol=0)


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
    assert cache.prefilled_tokens == cache.query_tokens - cache.hit_tokens   # all computed here
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
                tokens[e.request_id].append(e.tokens[0])
        engine.add_request("b", second, SamplingParams(max_tokens=12))
        shared = list(engine.scheduler.find("a").block_table.block_ids[:3])
        for e in engine.step():                              # b's prefill
            tokens[e.request_id].append(e.tokens[0])
        b = engine.scheduler.find("b")
        assert b.num_cached_tokens == (PREFIX_LEN if caching else 0)
        if caching:
            assert b.block_table.block_ids[:3] == shared
            assert [engine.pool.refcount(x) for x in shared] == [2, 2, 2]
        while engine.has_unfinished():
            for e in engine.step():
                tokens[e.request_id].append(e.tokens[0])
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

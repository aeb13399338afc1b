"""The log-probs of generated tokens and their top-N alternatives, from both model runners
(numpy, torch CPU), against Hugging Face's ``log_softmax`` of the same positions' logits on
the tiny checkpoints: the raw model's, whatever the sampling options (vLLM's default), for
the aggregated engine and for a context's first token; nothing computed for a request that
does not ask."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from triton_disagg.engine import sampling
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import Runtime
from triton_disagg.engine.sampling import SamplingParams

TOP = 5


@pytest.fixture(params=["numpy", "torch"])
def runtime(request) -> Runtime:
    return Runtime(request.param, "cpu", "float32")


@functools.lru_cache(maxsize=None)
def hf_model(checkpoint: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def hf_log_softmax(checkpoint: Path, ids: list[int]) -> np.ndarray:
    """HF's log_softmax of every position's logits for the sequence ``ids``: ``[n, V]``."""
    import torch

    with torch.no_grad():
        logits = hf_model(checkpoint)(torch.tensor([ids])).logits[0]     # [1, n, V] -> [n, V]
        return torch.log_softmax(logits, dim=-1).numpy()


def assert_match_hf(checkpoint: Path, prompt: list[int], output: list[int],
                    logprobs: list[float], tops: list) -> None:
    """Each generated token's log-prob and its TOP alternatives are HF's at its position."""
    hf = hf_log_softmax(checkpoint, prompt + output)[len(prompt) - 1:-1]   # [out, V]
    np.testing.assert_allclose(logprobs, hf[np.arange(len(output)), output], atol=1e-3)
    want = np.argsort(-hf, axis=1, kind="stable")[:, :TOP]                  # [out, TOP]
    got_ids = np.array([t.ids for t in tops])
    got_lps = np.array([t.logprobs for t in tops])
    np.testing.assert_allclose(got_lps, np.take_along_axis(hf, want, axis=1), atol=1e-3)
    # ids agree wherever two alternatives are not a float32 rounding apart
    distinct = np.abs(np.diff(np.take_along_axis(hf, want, axis=1), axis=1)) > 1e-3
    for row in range(len(output)):
        for j in range(TOP):
            if (j == 0 or distinct[row, j - 1]) and (j == TOP - 1 or distinct[row, j]):
                assert got_ids[row, j] == want[row, j]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("options", [
    {},                                                              # greedy
    {"temperature": 1.5, "top_k": 7, "seed": 11, "repetition_penalty": 1.3,
     "presence_penalty": 0.5},                                       # processed and sampled
])
def test_generated_top_logprobs_are_hfs_raw_log_softmax(family, options, runtime,
                                                        tiny_engines, tiny_checkpoints):
    engine = LLMEngine(tiny_engines[family], runtime=runtime)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, engine.spec.shape.vocab_size, n).tolist() for n in (4, 9)]
    asks = SamplingParams(max_tokens=6, return_log_probs=True, top_logprobs=TOP, **options)
    events: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, asks)
    while engine.has_unfinished():
        for event in engine.step():
            events[event.request_id].append(event)
    for prompt, mine in zip(prompts, events.values()):
        assert len(mine) == 6 and all(len(e.top[0].ids) == TOP for e in mine)
        assert_match_hf(tiny_checkpoints[family], prompt, [e.tokens[0] for e in mine],
                        [e.log_probs[0] for e in mine], [e.top[0] for e in mine])
    assert engine.pool.num_used == 0


def test_a_contexts_first_token_carries_its_alternatives(runtime, tiny_engines,
                                                         tiny_checkpoints):
    """prefill_only (the context role) gives the first token's TOP alternatives, a
    request batched with it that does not ask gets none."""
    engine = LLMEngine(tiny_engines["llama"], runtime=runtime)
    prompt = list(range(5, 17))
    asks = SamplingParams(max_tokens=4, return_log_probs=True, top_logprobs=TOP)
    quiet, loud = engine.prefill_only([("quiet", prompt, SamplingParams(max_tokens=4)),
                                       ("loud", prompt, asks)])
    assert quiet.top is None and quiet.logprob is None
    assert_match_hf(tiny_checkpoints["llama"], prompt, [loud.token_id], [loud.logprob],
                    [loud.top])
    engine.pool.free(loud.block_ids + quiet.block_ids)


def test_a_request_that_does_not_ask_computes_no_log_softmax(monkeypatch, tiny_engines):
    """Zero cost for a request without return_log_probs, whatever its sampling options;
    with top_logprobs but no return_log_probs nothing is computed either."""
    calls = []
    real = sampling.log_softmax
    monkeypatch.setattr(sampling, "log_softmax", lambda x: calls.append(1) or real(x))
    engine = LLMEngine(tiny_engines["llama"], runtime=Runtime("numpy", "cpu", "float32"))
    for params in (SamplingParams(max_tokens=3),
                   SamplingParams(max_tokens=3, temperature=0.7, repetition_penalty=1.2),
                   SamplingParams(max_tokens=3, top_logprobs=TOP)):
        engine.generate([[5, 6, 7]], params)
    assert calls == []
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, return_log_probs=True))
    assert len(calls) == 3                             # one per generated token

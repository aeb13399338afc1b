"""Hugging Face transformers as the engine's reference: its greedy tokens and logits on the
tiny checkpoints of every family, the prompts the tests feed both, and the fixtures that
build the engines under test (a test module imports them:
``from hf_reference import engines, runtime  # noqa: F401``).

``engines`` rebuilds the shared ``tiny_checkpoints`` with 4 tokens per block (so sequences
span several blocks) and max_batch_size 4 (so requests queue), once per test module. Tests
that check the math take the ``runtime`` fixture and run once per runner; control-logic
tests run on the numpy runner only (the logic is the same copy for both).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from checkpoints import build_engines
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import Runtime

FAMILIES = ["llama", "llama3", "qwen2", "mistral", "gpt2"]
PROMPT_LENGTHS = (1, 5, 12, 23)
MAX_TOKENS = (33, 40, 32, 36)


@pytest.fixture(params=["numpy", "torch"])
def runtime(request) -> Runtime:
    return Runtime(request.param, "cpu", "float32")


@pytest.fixture(scope="module")
def engines(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    return build_engines(tiny_checkpoints, tmp_path_factory.mktemp("block4"),
                         tokens_per_block=4, max_batch_size=4)


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

"""The models gpu_check.py measures: tiny engines of the five architectures (random
weights, written to disk for the parity and handoff sections) and Llama-shaped models
whose random weights are made on the device (speed), as engine specs and weight dicts.
Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from triton_disagg.engine.spec import EngineSpec, KVLayout, ModelShape
from triton_disagg.engine.weights import expected_shapes

TINY = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, intermediate_size=128, max_position_embeddings=512, norm_eps=1e-5,
            tie_word_embeddings=False)
ARCHITECTURES = {   # name -> ModelShape overrides of TINY
    "llama": dict(family="llama", architecture="LlamaForCausalLM", activation="silu",
                  qkv_bias=False),
    "llama3": dict(family="llama", architecture="LlamaForCausalLM", activation="silu",
                   qkv_bias=False, rope_scaling={
                       "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(family="llama", architecture="Qwen2ForCausalLM", activation="silu",
                  qkv_bias=True),
    "mistral": dict(family="llama", architecture="MistralForCausalLM", activation="silu",
                    qkv_bias=False, sliding_window=512),
    "gpt2": dict(family="gpt2", architecture="GPT2LMHeadModel", activation="gelu_new",
                 qkv_bias=True, tie_word_embeddings=True),
}
LLAMA_SHAPES = {    # name -> (ModelShape keyword arguments)
    "Llama-3.2-1B-shaped": dict(vocab_size=128256, hidden_size=2048, num_layers=16,
                                num_heads=32, num_kv_heads=8, head_dim=64,
                                intermediate_size=8192, tie_word_embeddings=True),
    "Llama-3-8B-shaped": dict(vocab_size=128256, hidden_size=4096, num_layers=32,
                              num_heads=32, num_kv_heads=8, head_dim=128,
                              intermediate_size=14336, tie_word_embeddings=False),
}
TINY_LLAMA_SHAPES = {"tiny-llama-shaped": dict(TINY, vocab_size=1024)}


def make_shape(**kw) -> ModelShape:
    base = dict(TINY, family="llama", architecture="LlamaForCausalLM", activation="silu",
                qkv_bias=False, max_position_embeddings=4096, rope_theta=500000.0)
    return ModelShape(**{**base, **kw})


def make_spec(shape: ModelShape, max_seq_len: int) -> EngineSpec:
    return EngineSpec(shape=shape, kv=KVLayout(16, "float32"), dtype="float32",
                      max_batch_size=64, max_seq_len=max_seq_len, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None, fingerprint="gpu-check")


def random_weights(shape: ModelShape, make) -> dict:
    """Every engine tensor from ``make(name, shape)``; 1-D tensors are norms (near 1) or
    biases (near 0)."""
    return {name: make(name, dims) for name, dims in expected_shapes(shape).items()}


def write_tiny_engine(directory: Path, name: str) -> Path:
    from safetensors.numpy import save_file

    shape = make_shape(**ARCHITECTURES[name])
    rng = np.random.default_rng(0)

    def make(weight: str, dims):
        if len(dims) == 1:
            base = 1.0 if "norm" in weight else 0.0
            return (base + 0.1 * rng.standard_normal(dims)).astype(np.float32)
        return (0.08 * rng.standard_normal(dims)).astype(np.float32)

    directory.mkdir(parents=True, exist_ok=True)
    save_file(random_weights(shape, make), str(directory / "weights.safetensors"))
    (directory / "engine.json").write_text(make_spec(shape, 256).to_json())
    return directory

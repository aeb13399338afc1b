"""Hugging Face tensors -> engine weights, laid out as `triton_disagg.engine.spec` says.

Invariants: the result has exactly the names of ``weight_names(shape)``, each
C-contiguous in the storage dtype; every linear weight is ``[out, in]`` (torch's
``nn.Linear`` layout; GPT-2's Conv1D weights are ``[in, out]`` and are transposed once
here); ``qkv`` rows are ``[q | k | v]`` and ``gate_up`` rows ``[gate | up]``. Q and K keep
Hugging Face's rotary layout (rotate-half: the pair of dimension ``d`` is ``d + head_dim/2``),
with no permutation. Every source tensor is shape-checked before use.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from triton_disagg.builders.checkpoint import Checkpoint
from triton_disagg.builders.errors import CheckpointError
from triton_disagg.engine.spec import ModelShape, STORAGE_DTYPES, weight_names

Weights = dict[str, np.ndarray]


def _llama_global(ckpt: Checkpoint, s: ModelShape) -> Weights:
    v, h = s.vocab_size, s.hidden_size
    out = {"embed": ckpt.tensor("model.embed_tokens.weight", (v, h)),        # [V, H]
           "final_norm.weight": ckpt.tensor("model.norm.weight", (h,))}
    if not s.tie_word_embeddings:
        out["lm_head.weight"] = ckpt.tensor("lm_head.weight", (v, h))        # [V, H]
    return out


def _llama_layer(ckpt: Checkpoint, s: ModelShape, i: int) -> Weights:
    h, q, kv, inter = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, \
        s.intermediate_size
    p, o = f"model.layers.{i}.", f"layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    proj = {n: ckpt.tensor(f"{attn}{n}_proj.weight", (width, h))            # [out, in]
            for n, width in (("q", q), ("k", kv), ("v", kv))}
    out = {o + "attn_norm.weight": ckpt.tensor(p + "input_layernorm.weight", (h,)),
           o + "qkv.weight": np.concatenate([proj["q"], proj["k"], proj["v"]]),  # [Q+2KV, H]
           o + "o.weight": ckpt.tensor(attn + "o_proj.weight", (h, q)),       # [H, Q]
           o + "mlp_norm.weight": ckpt.tensor(p + "post_attention_layernorm.weight", (h,)),
           o + "gate_up.weight": np.concatenate(
               [ckpt.tensor(mlp + "gate_proj.weight", (inter, h)),
                ckpt.tensor(mlp + "up_proj.weight", (inter, h))]),          # [2I, H]
           o + "down.weight": ckpt.tensor(mlp + "down_proj.weight", (h, inter))}  # [H, I]
    if s.qkv_bias:
        out[o + "qkv.bias"] = np.concatenate(
            [ckpt.tensor(f"{attn}{n}_proj.bias", (w,))
             for n, w in (("q", q), ("k", kv), ("v", kv))])                  # [Q+2KV]
    return out


def _gpt2_prefix(ckpt: Checkpoint) -> str:
    """Saved GPT2LMHeadModel names start with ``transformer.``; bare GPT2Model ones don't."""
    return "" if ckpt.has("wte.weight") and not ckpt.has("transformer.wte.weight") \
        else "transformer."


def _gpt2_global(ckpt: Checkpoint, s: ModelShape) -> Weights:
    t, v, h = _gpt2_prefix(ckpt), s.vocab_size, s.hidden_size
    out = {"embed": ckpt.tensor(t + "wte.weight", (v, h)),                    # [V, H]
           "pos_embed": ckpt.tensor(t + "wpe.weight", (s.max_position_embeddings, h)),
           "final_norm.weight": ckpt.tensor(t + "ln_f.weight", (h,)),
           "final_norm.bias": ckpt.tensor(t + "ln_f.bias", (h,))}
    if not s.tie_word_embeddings:
        out["lm_head.weight"] = ckpt.tensor("lm_head.weight", (v, h))        # [V, H]
    return out


_CONV1D = ("qkv.weight", "o.weight", "fc.weight", "proj.weight")


def _gpt2_layer(ckpt: Checkpoint, s: ModelShape, i: int) -> Weights:
    h, inter = s.hidden_size, s.intermediate_size
    p, o = f"{_gpt2_prefix(ckpt)}h.{i}.", f"layers.{i}."
    names = {  # engine name: (HF name, shape); Conv1D weights are [in, out]
        "attn_norm.weight": ("ln_1.weight", (h,)), "attn_norm.bias": ("ln_1.bias", (h,)),
        "qkv.weight": ("attn.c_attn.weight", (h, 3 * h)),
        "qkv.bias": ("attn.c_attn.bias", (3 * h,)),
        "o.weight": ("attn.c_proj.weight", (h, h)), "o.bias": ("attn.c_proj.bias", (h,)),
        "mlp_norm.weight": ("ln_2.weight", (h,)), "mlp_norm.bias": ("ln_2.bias", (h,)),
        "fc.weight": ("mlp.c_fc.weight", (h, inter)), "fc.bias": ("mlp.c_fc.bias", (inter,)),
        "proj.weight": ("mlp.c_proj.weight", (inter, h)), "proj.bias": ("mlp.c_proj.bias", (h,)),
    }
    return {o + name: ckpt.tensor(p + hf, shape).T if name in _CONV1D else ckpt.tensor(p + hf, shape)
            for name, (hf, shape) in names.items()}         # Conv1D [in, out] -> [out, in]


def _cast(name: str, array: np.ndarray, dtype: str, ckpt: Checkpoint) -> np.ndarray:
    out = np.ascontiguousarray(array, dtype=dtype)
    if not np.isfinite(out).all():
        raise CheckpointError(f"{ckpt.weights_file}: tensor for '{name}' has values that are "
                              f"not finite in {dtype}; build with --dtype float32")
    return out


def convert_weights(ckpt: Checkpoint, dtype: str = "float32",
                    progress: Callable[[str], None] | None = None) -> Weights:
    """Every engine tensor of ``ckpt`` in storage ``dtype``; ``progress`` gets one line
    per layer ("converting layer 3/12")."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"dtype must be one of {STORAGE_DTYPES}, got {dtype!r}")
    s = ckpt.shape
    glob, layer = (_gpt2_global, _gpt2_layer) if s.family == "gpt2" else \
        (_llama_global, _llama_layer)
    out = {name: _cast(name, a, dtype, ckpt) for name, a in glob(ckpt, s).items()}
    for i in range(s.num_layers):
        if progress:
            progress(f"converting layer {i + 1}/{s.num_layers}")
        out.update({name: _cast(name, a, dtype, ckpt) for name, a in layer(ckpt, s, i).items()})
    assert sorted(out) == sorted(weight_names(s)), "converter out of step with weight_names"
    return out

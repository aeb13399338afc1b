"""The engine directory contract shared by `builders/` (writer) and the engine (reader).

An engine directory holds:

- ``engine.json``: one :class:`EngineSpec`, serialised with :meth:`EngineSpec.to_json`.
- ``weights.safetensors``: every tensor named in :func:`weight_names`, already laid
  out for inference: every linear weight is stored ``[out_features, in_features]``
  (rows are output features), the layout this machine's BLAS streams fastest for
  batches of 2-16 rows and as fast at one row (measured; GPT-2's ``[in, out]``
  Conv1D weights are transposed once at build time); Q, K and V are fused into one
  ``qkv`` matrix whose rows are ``[q heads | k heads | v heads]``; Llama-style gate
  and up projections are fused into one ``gate_up`` matrix whose rows are
  ``[gate | up]``. Tensors are in ``spec.dtype`` (float32 or float16
  storage; the engine computes in float32).
- ``tokenizer.json`` (and ``tokenizer_config.json`` when the checkpoint has one),
  copied from the checkpoint.

Invariants: ``num_heads % num_kv_heads == 0``; ``head_dim * num_heads`` is the width
of the attention output; the fingerprint changes whenever the source checkpoint's
bytes or any build option changes, and nothing else changes it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
# Any here: values of a checkpoint's JSON config.

from triton_disagg.errors import UserError
from triton_disagg.kv.layout import BlockGeometry

ENGINE_JSON = "engine.json"
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_FILE = "tokenizer.json"
BUILDER_VERSION = "2"  # 2: linear weights [out, in]

# Families the numpy engine knows. "llama" covers LlamaForCausalLM, Qwen2ForCausalLM
# (qkv_bias=True) and MistralForCausalLM; "gpt2" covers GPT2LMHeadModel.
FAMILIES = ("llama", "gpt2")
STORAGE_DTYPES = ("float32", "float16")


class EngineFormatError(UserError):
    """An engine directory that is missing, corrupt or from another builder version."""


@dataclass(frozen=True)
class ModelShape:
    """Architecture hyper-parameters, independent of the source checkpoint format."""

    family: str                      # "llama" | "gpt2"
    architecture: str                # the checkpoint's own name, e.g. "Qwen2ForCausalLM"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    activation: str                  # "silu" (gated, llama) | "gelu_new" (gpt2)
    qkv_bias: bool                   # Qwen2 and GPT-2: True
    tie_word_embeddings: bool
    rope_theta: float = 10000.0      # llama family only
    rope_scaling: dict[str, Any] | None = None  # HF "rope_scaling" dict (llama3 type supported)
    sliding_window: int | None = None  # Mistral; informational, the engine refuses longer contexts


@dataclass(frozen=True)
class KVLayout:
    """How one KV block is laid out in memory.

    A block pool is one array ``[num_blocks, num_layers, 2, tokens_per_block,
    num_kv_heads, head_dim]`` (index 0 of axis 2 is K, 1 is V), so each block is one
    contiguous byte range: the unit a KV transfer moves.
    """

    tokens_per_block: int = 16
    dtype: str = "float32"           # "float32" | "float16"


@dataclass(frozen=True)
class EngineSpec:
    shape: ModelShape
    kv: KVLayout
    dtype: str                       # storage dtype of the weights
    max_batch_size: int
    max_seq_len: int                 # prompt + generated tokens, per sequence
    bos_token_id: int | None
    eos_token_id: int | None         # default end id
    pad_token_id: int | None
    fingerprint: str                 # sha256 hex of the source checkpoint bytes + build options
    builder_version: str = BUILDER_VERSION
    source: dict[str, Any] = field(default_factory=dict)  # checkpoint path, options (informational)

    @functools.cached_property
    def max_context(self) -> int:
        """The longest sequence (prompt + generated tokens) the engine runs; worked out once
        per spec, so that checking a request against it runs no code here (docs/architecture.md's
        table of the files a request runs code in counts this module out)."""
        s = self.shape
        return min(self.max_seq_len, s.max_position_embeddings,
                   s.sliding_window or self.max_seq_len)

    def block_geometry(self, layout: KVLayout | None = None) -> BlockGeometry:
        """One KV block of this model in ``layout`` (default: the engine's own)."""
        s, kv = self.shape, layout or self.kv
        return BlockGeometry(s.num_layers, s.num_kv_heads, s.head_dim, kv.tokens_per_block,
                             kv.dtype)

    def check_pool(self, geometry: BlockGeometry) -> None:
        """Raise ValueError unless a pool of ``geometry`` holds this model's KV (layers, KV
        heads, head size; any tokens per block and KV dtype)."""
        if not geometry.same_model(self.block_geometry()):
            raise ValueError(f"KV pool geometry {geometry} does not match the model shape")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "EngineSpec":
        raw = json.loads(text)
        return cls(
            shape=ModelShape(**raw.pop("shape")),
            kv=KVLayout(**raw.pop("kv")),
            **raw,
        )

    @classmethod
    def load(cls, engine_dir: str | Path) -> "EngineSpec":
        path = Path(engine_dir) / ENGINE_JSON
        if not path.is_file():
            raise EngineFormatError(f"{path}: not found; build an engine with `triton-disagg build`")
        try:
            spec = cls.from_json(path.read_text())
        except (json.JSONDecodeError, TypeError, KeyError) as exc:
            raise EngineFormatError(f"{path}: not a valid engine.json ({exc})") from exc
        if spec.builder_version != BUILDER_VERSION:
            raise EngineFormatError(
                f"{path}: built by builder version {spec.builder_version}, this engine reads "
                f"version {BUILDER_VERSION}; rebuild with `triton-disagg build --force`"
            )
        return spec


def weight_names(shape: ModelShape) -> list[str]:
    """Every tensor name in ``weights.safetensors``, with its layout in the comment.

    H = hidden_size, I = intermediate_size, V = vocab_size,
    Q = num_heads * head_dim, KV = num_kv_heads * head_dim.
    """
    names = ["embed"]                                  # [V, H]
    if shape.family == "gpt2":
        names.append("pos_embed")                      # [max_position_embeddings, H]
    for i in range(shape.num_layers):
        p = f"layers.{i}."
        names += [p + "attn_norm.weight"]              # [H]
        if shape.family == "gpt2":
            names += [p + "attn_norm.bias"]            # [H]
        names += [p + "qkv.weight"]                    # [Q + 2*KV, H]
        if shape.qkv_bias:
            names += [p + "qkv.bias"]                  # [Q + 2*KV]
        names += [p + "o.weight"]                      # [H, Q]
        if shape.family == "gpt2":
            names += [p + "o.bias"]                    # [H]
        names += [p + "mlp_norm.weight"]               # [H]
        if shape.family == "gpt2":
            names += [p + "mlp_norm.bias",             # [H]
                      p + "fc.weight", p + "fc.bias",  # [I, H], [I]
                      p + "proj.weight", p + "proj.bias"]  # [H, I], [H]
        else:
            names += [p + "gate_up.weight",            # [2*I, H] rows [gate | up]
                      p + "down.weight"]               # [H, I]
    names.append("final_norm.weight")                  # [H]
    if shape.family == "gpt2":
        names.append("final_norm.bias")                # [H]
    if not shape.tie_word_embeddings:
        names.append("lm_head.weight")                 # [V, H]; tied models use embed
    return names

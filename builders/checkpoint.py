"""Read a Hugging Face checkpoint directory: config, tokenizer, safetensors weights.

Invariants: a :class:`Checkpoint` that loaded has a supported architecture, a
``tokenizer.json`` the ``tokenizers`` library can load, and a header for every
safetensors file it names (so tensor look-ups never touch an unlisted file).
``Checkpoint.files`` lists every file whose bytes define the checkpoint, in a fixed
order, for fingerprinting. Every failure is a :class:`CheckpointError` whose one-line
message starts with the offending file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from triton_disagg.engine.spec import ModelShape, TOKENIZER_FILE
from triton_disagg.builders.errors import CheckpointError, one_line
from triton_disagg.builders.safetensors_io import TensorRef, read_safetensors_header, read_tensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
OPTIONAL_JSON = ("generation_config.json", "tokenizer_config.json")
SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "llama",
             "MistralForCausalLM": "llama", "GPT2LMHeadModel": "gpt2"}
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel"}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({one_line(exc)})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _get(cfg: dict[str, Any], path: Path, *keys: str, default: Any = None, kind: type = int):
    """The first of ``keys`` present in ``cfg`` (``default`` if none), type-checked."""
    value = next((cfg[k] for k in keys if cfg.get(k) is not None), default)
    if value is None:
        raise CheckpointError(f"{path}: missing key '{keys[0]}'")
    allowed = (int, float) if kind is float else kind
    if isinstance(value, bool) or not isinstance(value, allowed) or value <= 0:
        raise CheckpointError(f"{path}: key '{keys[0]}' must be a positive {kind.__name__}, "
                              f"got {value!r}")
    return kind(value)


def _rope(cfg: dict[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from transformers 4 (``rope_theta`` +
    ``rope_scaling``) or transformers 5 (``rope_parameters``) config keys."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = float(params.pop("rope_theta", cfg.get("rope_theta") or 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(f"{path}: rope type {rope_type!r} is not supported "
                              f"(supported: default, llama3)")
    missing = [k for k in _LLAMA3_KEYS if params.get(k) is None]
    if missing:
        raise CheckpointError(f"{path}: llama3 rope scaling lacks {', '.join(missing)}")
    return theta, {"rope_type": "llama3", **{k: params[k] for k in _LLAMA3_KEYS}}


def _refuse(path: Path, arch: str, cfg: dict[str, Any], flags: dict[str, bool]) -> None:
    for key, bad in flags.items():
        if cfg.get(key, not bad) == bad:
            raise CheckpointError(f"{path}: {arch} with {key}={bad} is not supported")


def model_shape(cfg: dict[str, Any], path: Path) -> ModelShape:
    """Map a Hugging Face config.json (at ``path``) onto :class:`ModelShape`."""
    archs = cfg.get("architectures") or [_BY_MODEL_TYPE.get(cfg.get("model_type"), "unknown")]
    arch = next((a for a in archs if a in SUPPORTED), None)
    if arch is None:
        raise CheckpointError(f"{path}: architecture {', '.join(map(str, archs))} is not "
                              f"supported (supported: {', '.join(SUPPORTED)})")
    if SUPPORTED[arch] == "gpt2":
        _refuse(path, arch, cfg, {"scale_attn_by_inverse_layer_idx": True,
                                  "scale_attn_weights": False})
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise CheckpointError(f"{path}: activation_function {act!r} is not supported")
        hidden, heads = _get(cfg, path, "n_embd", "hidden_size"), _get(cfg, path, "n_head")
        if hidden % heads:
            raise CheckpointError(f"{path}: n_embd {hidden} is not divisible by n_head {heads}")
        return ModelShape(
            family="gpt2", architecture=arch, vocab_size=_get(cfg, path, "vocab_size"),
            hidden_size=hidden, num_layers=_get(cfg, path, "n_layer"), num_heads=heads,
            num_kv_heads=heads, head_dim=hidden // heads,
            intermediate_size=_get(cfg, path, "n_inner", default=4 * hidden),
            max_position_embeddings=_get(cfg, path, "n_positions"),
            norm_eps=_get(cfg, path, "layer_norm_epsilon", default=1e-5, kind=float),
            activation="gelu_new", qkv_bias=True,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    _refuse(path, arch, cfg, {"attention_bias": True, "mlp_bias": True})
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported "
                              f"(supported: silu)")
    hidden, heads = _get(cfg, path, "hidden_size"), _get(cfg, path, "num_attention_heads")
    kv_heads = _get(cfg, path, "num_key_value_heads", default=heads)
    if heads % kv_heads or (cfg.get("head_dim") is None and hidden % heads):
        raise CheckpointError(f"{path}: num_attention_heads {heads} must be a multiple of "
                              f"num_key_value_heads {kv_heads} and divide hidden_size {hidden}")
    theta, scaling = _rope(cfg, path)
    windowed = cfg.get("use_sliding_window", arch != "Qwen2ForCausalLM")
    window = _get(cfg, path, "sliding_window") if windowed and cfg.get("sliding_window") else None
    return ModelShape(
        family="llama", architecture=arch, vocab_size=_get(cfg, path, "vocab_size"),
        hidden_size=hidden, num_layers=_get(cfg, path, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=kv_heads, head_dim=_get(cfg, path, "head_dim", default=hidden // heads),
        intermediate_size=_get(cfg, path, "intermediate_size"),
        max_position_embeddings=_get(cfg, path, "max_position_embeddings"),
        norm_eps=_get(cfg, path, "rms_norm_eps", default=1e-6, kind=float),
        activation="silu", qkv_bias=arch == "Qwen2ForCausalLM",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=theta, rope_scaling=scaling, sliding_window=window)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    shape: ModelShape
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    files: tuple[Path, ...]           # every file that defines the checkpoint, fixed order
    weights_file: Path                # model.safetensors or the index: named in errors
    tensors: dict[str, TensorRef]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor ``name`` as float32, checked to have exactly ``shape``."""
        ref = self.tensors.get(name)
        if ref is None:
            raise CheckpointError(f"{self.weights_file}: missing tensor '{name}'")
        if ref.shape != tuple(shape):
            raise CheckpointError(f"{ref.file}: tensor '{name}' has shape {list(ref.shape)}, "
                                  f"expected {list(shape)}")
        return read_tensor(ref, name)


def _weight_files(path: Path) -> tuple[Path, list[Path]]:
    """(file to name in errors, safetensors files in load order)."""
    index, single = path / INDEX_FILE, path / SINGLE_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: has no 'weight_map' object")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not (path / shard).is_file():
                raise CheckpointError(f"{index}: names shard {shard}, which is missing")
        return index, [path / s for s in shards]
    if single.is_file():
        return single, [single]
    bins = sorted(p.name for p in path.glob("*.bin"))
    hint = f"; found {', '.join(bins)}, but only safetensors are supported" if bins else ""
    raise CheckpointError(f"{single}: not found (nor {INDEX_FILE}){hint}")


def _load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    if not path.is_file():
        raise CheckpointError(f"{path}: not found; the checkpoint needs a fast tokenizer "
                              f"(save one with tokenizer.save_pretrained(DIR))")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad files
        raise CheckpointError(f"{path}: not a valid tokenizer.json ({one_line(exc)})") from exc


def _token_id(key: str, sources: list[tuple[Path, dict[str, Any]]], tok_cfg: dict, tokenizer,
              tok_cfg_path: Path, vocab_size: int) -> int | None:
    """``{key}_token_id`` from the first source that sets it (a list: its first id), else
    the id of tokenizer_config's ``{key}_token`` string."""
    for origin, data in sources:
        value = data.get(f"{key}_token_id")
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            break
    else:
        origin, token = tok_cfg_path, tok_cfg.get(f"{key}_token")
        token = token.get("content") if isinstance(token, dict) else token
        value = tokenizer.token_to_id(token) if isinstance(token, str) else None
        if token is not None and value is None:
            raise CheckpointError(f"{origin}: {key}_token {token!r} is not in tokenizer.json")
    if value is not None and not (isinstance(value, int) and 0 <= value < vocab_size):
        raise CheckpointError(f"{origin}: {key}_token_id {value!r} is not a token id below "
                              f"vocab_size {vocab_size}")
    return value


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read and validate a checkpoint directory (tensor bytes are read later, lazily)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: not found; a Hugging Face checkpoint directory "
                              f"needs config.json")
    config = read_json(config_path)
    shape = model_shape(config, config_path)
    tokenizer = _load_tokenizer(path / TOKENIZER_FILE)
    if tokenizer.get_vocab_size() > shape.vocab_size:
        raise CheckpointError(f"{path / TOKENIZER_FILE}: has {tokenizer.get_vocab_size()} tokens, "
                              f"more than config.json vocab_size {shape.vocab_size}")
    extra = {name: read_json(path / name) for name in OPTIONAL_JSON if (path / name).is_file()}
    gen_path, tok_cfg_path = path / OPTIONAL_JSON[0], path / OPTIONAL_JSON[1]
    sources = [(gen_path, extra.get(gen_path.name, {})), (config_path, config)]
    ids = {key: _token_id(key, sources, extra.get(tok_cfg_path.name, {}), tokenizer,
                          tok_cfg_path, shape.vocab_size) for key in ("bos", "eos", "pad")}
    weights_file, shards = _weight_files(path)
    tensors: dict[str, TensorRef] = {}
    for shard in shards:
        tensors.update(read_safetensors_header(shard)[0])
    files = [config_path, *(path / n for n in sorted(extra)), path / TOKENIZER_FILE]
    files += [weights_file] if weights_file.name == INDEX_FILE else []
    return Checkpoint(path, shape, ids["bos"], ids["eos"], ids["pad"], tuple(files + shards),
                      weights_file, tensors)

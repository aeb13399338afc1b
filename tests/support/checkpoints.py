"""Tiny random Hugging Face checkpoints for tests, built offline with transformers + torch.

Every ``make_*_checkpoint(directory, *, seed=0, sharded=False, **overrides)`` writes a
real ``save_pretrained`` checkpoint (config.json, generation_config.json, safetensors)
plus the demo byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json; ids 0/1/2
are bos/eos/pad), and returns the directory. ``overrides`` are config keyword arguments.
Invariants: the same arguments give the same weights (``torch.manual_seed``); float32;
``initializer_range`` 0.08 (GPT-2: 0.2) so greedy decoding gives varied tokens; every 1-D parameter
(norm weights, biases) is perturbed away from 1/0 so that a swapped or dropped one shows
up in comparisons; ``sharded=True`` saves ~200 KB shards plus
``model.safetensors.index.json``.
"""

from __future__ import annotations

from pathlib import Path

from triton_disagg.builders.demo import (BOS_ID, EOS_ID, PAD_ID, demo_vocab_size,
                                         write_demo_tokenizer)

SHARD_SIZE = "200KB"
INIT_STD = 0.08
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
LLAMA_SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128,
               "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-5}
GPT2_SIZES = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512,
              "layer_norm_epsilon": 1e-5, "initializer_range": 0.2}  # tied: 0.08 repeats


def _make(config_cls, model_cls, directory: str | Path, defaults: dict, overrides: dict,
          seed: int, sharded: bool) -> Path:
    import torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = config_cls(**{"vocab_size": demo_vocab_size(), "bos_token_id": BOS_ID,
                           "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
                           "initializer_range": INIT_STD, **defaults, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:                      # norm weights and biases
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, max_shard_size=SHARD_SIZE if sharded else "10GB")
    positions = overrides.get("max_position_embeddings", overrides.get("n_positions", 512))
    write_demo_tokenizer(directory, positions)
    return directory


def make_llama_checkpoint(directory: str | Path, *, seed: int = 0, sharded: bool = False,
                          llama3_rope: bool = False, **overrides) -> Path:
    """LlamaForCausalLM with GQA (4 heads, 2 KV heads); ``llama3_rope`` adds
    LLAMA3_ROPE_SCALING."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_scaling": dict(LLAMA3_ROPE_SCALING)} if llama3_rope else {}
    return _make(LlamaConfig, LlamaForCausalLM, directory, {**LLAMA_SIZES, **rope}, overrides,
                 seed, sharded)


def make_qwen2_checkpoint(directory: str | Path, *, seed: int = 0, sharded: bool = False,
                          **overrides) -> Path:
    """Qwen2ForCausalLM (QKV bias), same sizes as the Llama one."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _make(Qwen2Config, Qwen2ForCausalLM, directory, LLAMA_SIZES, overrides, seed,
                 sharded)


def make_mistral_checkpoint(directory: str | Path, *, seed: int = 0, sharded: bool = False,
                            **overrides) -> Path:
    """MistralForCausalLM with sliding_window 256 (engines default to max_seq_len 256)."""
    from transformers import MistralConfig, MistralForCausalLM

    return _make(MistralConfig, MistralForCausalLM, directory,
                 {**LLAMA_SIZES, "sliding_window": 256}, overrides, seed, sharded)


def make_gpt2_checkpoint(directory: str | Path, *, seed: int = 0, sharded: bool = False,
                         **overrides) -> Path:
    """GPT2LMHeadModel (tied embeddings, gelu_new, fused c_attn)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return _make(GPT2Config, GPT2LMHeadModel, directory, GPT2_SIZES, overrides, seed, sharded)


MAKERS = {"llama": make_llama_checkpoint, "qwen2": make_qwen2_checkpoint,
          "mistral": make_mistral_checkpoint, "gpt2": make_gpt2_checkpoint}


def build_engines(checkpoints: dict[str, Path], root: Path, **options) -> dict[str, Path]:
    """family -> the engine built from ``checkpoints[family]`` into ``root / family`` with
    the builder's ``options`` (``tokens_per_block``, ``max_batch_size``, ...)."""
    from triton_disagg.builders.build import build_engine

    for family, checkpoint in checkpoints.items():
        build_engine(checkpoint, root / family, **options)
    return {family: root / family for family in checkpoints}

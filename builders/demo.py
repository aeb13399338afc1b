"""A small seeded Llama checkpoint in real Hugging Face layout, for the demo and tests.

Invariants: the same seed and size overrides give byte-identical files; weights come
from numpy alone (no torch); the tokenizer is a byte-level BPE trained on
``demo_corpus.txt``, so any UTF-8 text (Chinese, emoji) round-trips; token ids 0, 1, 2
are ``<|begin_of_text|>`` (bos), ``<|end_of_text|>`` (eos) and ``<|pad|>`` (pad), and
``encode`` prepends bos, as Llama 3's tokenizer does. The seed and sizes are recorded
under config.json's ``demo_checkpoint`` key, which makes rewriting the same checkpoint a
no-op. (Not in safetensors metadata: its key order is not stable between writes.)
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np

from triton_disagg.builders.build import replace_dir, save_safetensors, staging_dir
from triton_disagg.builders.checkpoint import read_json
from triton_disagg.builders.errors import CheckpointError
from triton_disagg.errors import UserError

CORPUS = Path(__file__).with_name("demo_corpus.txt")
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
TOKENIZER_VOCAB_SIZE = 2048
DEFAULT_SIZES = {"vocab_size": None,  # None: the tokenizer's vocabulary size
                 "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
                 "num_key_value_heads": 4, "intermediate_size": 688,
                 "max_position_embeddings": 2048}
LINEAR_STD, EMBED_STD = 0.02, 0.1   # larger embed/lm_head std: greedy text isn't one token
# Each message as "<|role|>\n" + content + eos, then the assistant's turn: a chat format of
# plain text plus the eos token, which the demo model's vocabulary already has.
CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
                 "{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json")


@functools.lru_cache(maxsize=1)
def demo_tokenizer_json() -> str:
    """tokenizer.json text of the demo tokenizer (trained once per process, deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bos = SPECIAL_TOKENS[BOS_ID]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                      special_tokens=[(bos, BOS_ID)])])
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB_SIZE, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(), trainer)
    return tok.to_str()


def demo_vocab_size() -> int:
    return len(json.loads(demo_tokenizer_json())["model"]["vocab"])


def write_demo_tokenizer(directory: str | Path, model_max_length: int = 2048) -> int:
    """Write tokenizer.json and tokenizer_config.json into ``directory``; return the
    vocabulary size."""
    directory = Path(directory)
    (directory / "tokenizer.json").write_text(demo_tokenizer_json(), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[BOS_ID],
              "eos_token": SPECIAL_TOKENS[EOS_ID], "pad_token": SPECIAL_TOKENS[PAD_ID],
              "clean_up_tokenization_spaces": False, "model_max_length": model_max_length,
              "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return demo_vocab_size()


def _config(sizes: dict[str, int], marker: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **sizes,
            "head_dim": sizes["hidden_size"] // sizes["num_attention_heads"],
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False, "initializer_range": LINEAR_STD,
            "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
            "torch_dtype": "float32", "use_cache": True, "demo_checkpoint": marker}


def _weights(sizes: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    """HF-named tensors, torch layout ``[out, in]``, drawn in a fixed order."""
    rng = np.random.default_rng(seed)
    h, v, inter = sizes["hidden_size"], sizes["vocab_size"], sizes["intermediate_size"]
    head_dim = h // sizes["num_attention_heads"]
    q, kv = h, sizes["num_key_value_heads"] * head_dim

    def normal(shape: tuple[int, int], std: float = LINEAR_STD) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    out = {"model.embed_tokens.weight": normal((v, h), EMBED_STD)}
    for i in range(sizes["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": normal((q, h)),
                    p + "self_attn.k_proj.weight": normal((kv, h)),
                    p + "self_attn.v_proj.weight": normal((kv, h)),
                    p + "self_attn.o_proj.weight": normal((h, q)),
                    p + "mlp.gate_proj.weight": normal((inter, h)),
                    p + "mlp.up_proj.weight": normal((inter, h)),
                    p + "mlp.down_proj.weight": normal((h, inter)),
                    p + "input_layernorm.weight": np.ones(h, np.float32),
                    p + "post_attention_layernorm.weight": np.ones(h, np.float32)})
    out["model.norm.weight"] = np.ones(h, np.float32)
    out["lm_head.weight"] = normal((v, h), EMBED_STD)
    return out


def _marker(output: Path) -> dict | None:
    """The demo marker of the checkpoint at ``output``, None if it isn't a complete one."""
    if not all((output / name).is_file() for name in FILES):
        return None
    try:
        return read_json(output / "config.json").get("demo_checkpoint")
    except CheckpointError:
        return None


def write_demo_checkpoint(output_dir: str | Path, seed: int = 0, **overrides: int) -> bool:
    """Write the demo checkpoint into ``output_dir``; False if it was already there with
    the same seed and sizes. ``overrides`` replace entries of DEFAULT_SIZES."""
    unknown = set(overrides) - set(DEFAULT_SIZES)
    if unknown:
        raise TypeError(f"unknown demo size overrides: {sorted(unknown)}")
    output = Path(output_dir)
    sizes = {**DEFAULT_SIZES, **overrides}
    tokens = demo_vocab_size()
    sizes["vocab_size"] = sizes["vocab_size"] or tokens
    if sizes["vocab_size"] < tokens:
        raise ValueError(f"vocab_size {sizes['vocab_size']} < tokenizer vocabulary {tokens}")
    corpus = hashlib.sha256(CORPUS.read_bytes()).hexdigest()
    marker = {"seed": seed, "sizes": sizes, "corpus_sha256": corpus,
              "chat_template_sha256": hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()}
    existing = _marker(output) if output.is_dir() else None
    if existing == marker:
        return False
    if output.exists() and existing is None and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"{output}: exists and is not a demo checkpoint; refusing to overwrite "
                        f"it, choose another --output")
    staged = staging_dir(output)
    try:
        (staged / "config.json").write_text(json.dumps(_config(sizes, marker), indent=2) + "\n")
        generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
        (staged / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        write_demo_tokenizer(staged, sizes["max_position_embeddings"])
        save_safetensors(_weights(sizes, seed), staged / "model.safetensors", {"format": "pt"})
        replace_dir(staged, output)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return True

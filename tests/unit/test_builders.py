"""builders/: checkpoint reading, conversion layout, build caching, errors, CLI, demo."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from checkpoints import make_llama_checkpoint
from triton_disagg.builders.build import build_engine
from triton_disagg.builders.demo import write_demo_checkpoint
from triton_disagg.cli import main
from triton_disagg.engine.spec import EngineSpec, weight_names
from triton_disagg.errors import UserError

ARCHS = {"llama": "LlamaForCausalLM", "llama3": "LlamaForCausalLM",
         "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel"}
TEXTS = ["The quick brown fox jumps over the lazy dog.", "我们今天去公园散步，天气很好。",
         "Party time 🎉🎂👋 — café ❤️"]


def engine_weights(engine: Path) -> dict[str, np.ndarray]:
    return load_file(str(engine / "weights.safetensors"))


def copy_checkpoint(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "ckpt"))


@pytest.mark.parametrize("family", sorted(ARCHS))
def test_each_architecture_builds(family, tiny_engines):
    spec = EngineSpec.load(tiny_engines[family])
    weights = engine_weights(tiny_engines[family])
    assert spec.shape.architecture == ARCHS[family]
    assert sorted(weights) == sorted(weight_names(spec.shape))
    assert all(w.dtype == np.float32 for w in weights.values())
    assert (tiny_engines[family] / "tokenizer.json").is_file()
    assert (spec.bos_token_id, spec.eos_token_id, spec.pad_token_id) == (0, 1, 2)


def test_shapes_mapped(tiny_engines):
    llama3 = EngineSpec.load(tiny_engines["llama3"]).shape
    assert llama3.rope_scaling["rope_type"] == "llama3" and llama3.rope_scaling["factor"] == 8.0
    mistral = EngineSpec.load(tiny_engines["mistral"])
    assert mistral.shape.sliding_window == 256 and mistral.max_seq_len == 256
    gpt2 = EngineSpec.load(tiny_engines["gpt2"]).shape
    assert (gpt2.tie_word_embeddings, gpt2.activation, gpt2.intermediate_size) == \
        (True, "gelu_new", 256)
    assert EngineSpec.load(tiny_engines["qwen2"]).shape.qkv_bias


def test_llama_weights_equal_hf_fused(tiny_checkpoints, tiny_engines):
    """Linear weights keep torch's [out, in]; q/k/v and gate/up are stacked by rows."""
    for family in ("llama", "qwen2"):
        hf = load_file(str(tiny_checkpoints[family] / "model.safetensors"))
        ours = engine_weights(tiny_engines[family])
        p = "model.layers.1."
        qkv = np.concatenate([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        np.testing.assert_array_equal(ours["layers.1.qkv.weight"], qkv)
        gate_up = np.concatenate([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        np.testing.assert_array_equal(ours["layers.1.gate_up.weight"], gate_up)
        for name, hf_name in (("down", "mlp.down_proj"), ("o", "self_attn.o_proj")):
            np.testing.assert_array_equal(ours[f"layers.1.{name}.weight"],
                                          hf[f"{p}{hf_name}.weight"])
        np.testing.assert_array_equal(ours["layers.1.mlp_norm.weight"],
                                      hf[p + "post_attention_layernorm.weight"])
        np.testing.assert_array_equal(ours["lm_head.weight"], hf["lm_head.weight"])
        np.testing.assert_array_equal(ours["embed"], hf["model.embed_tokens.weight"])
    bias = np.concatenate([hf[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
    np.testing.assert_array_equal(ours["layers.1.qkv.bias"], bias)  # qwen2


def test_gpt2_weights_equal_hf(tiny_checkpoints, tiny_engines):
    """Conv1D weights ([in, out]) are transposed once to [out, in]; the rest is copied."""
    hf = load_file(str(tiny_checkpoints["gpt2"] / "model.safetensors"))
    ours = engine_weights(tiny_engines["gpt2"])
    t = "transformer."
    for engine_name, hf_name in [("layers.0.qkv.weight", "h.0.attn.c_attn.weight"),
                                 ("layers.0.o.weight", "h.0.attn.c_proj.weight"),
                                 ("layers.1.fc.weight", "h.1.mlp.c_fc.weight"),
                                 ("layers.1.proj.weight", "h.1.mlp.c_proj.weight")]:
        np.testing.assert_array_equal(ours[engine_name], hf[t + hf_name].T)
    for engine_name, hf_name in [("embed", "wte.weight"), ("pos_embed", "wpe.weight"),
                                 ("layers.0.qkv.bias", "h.0.attn.c_attn.bias"),
                                 ("final_norm.bias", "ln_f.bias")]:
        np.testing.assert_array_equal(ours[engine_name], hf[t + hf_name])
    assert "lm_head.weight" not in ours


def test_explicit_head_dim_and_tied_llama(tmp_path):
    ckpt = make_llama_checkpoint(tmp_path / "c", head_dim=32, tie_word_embeddings=True)
    spec, _ = build_engine(ckpt, tmp_path / "e")
    weights = engine_weights(tmp_path / "e")
    assert spec.shape.head_dim == 32
    assert weights["layers.0.qkv.weight"].shape == (4 * 32 + 2 * 2 * 32, 64)
    assert "lm_head.weight" not in weights


def test_sharded_equals_unsharded(tmp_path):
    sharded = make_llama_checkpoint(tmp_path / "s", sharded=True, seed=3)
    single = make_llama_checkpoint(tmp_path / "u", seed=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    build_engine(sharded, tmp_path / "es")
    build_engine(single, tmp_path / "eu")
    a, b = engine_weights(tmp_path / "es"), engine_weights(tmp_path / "eu")
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_rebuild_is_noop_force_rebuilds_options_change_fingerprint(tiny_checkpoints, tmp_path):
    lines: list[str] = []
    out = tmp_path / "engine"
    first, built = build_engine(tiny_checkpoints["llama"], out, progress=lines.append)
    assert built and "converting layer 2/2" in lines
    lines.clear()
    again, built = build_engine(tiny_checkpoints["llama"], out, progress=lines.append)
    assert not built and again.fingerprint == first.fingerprint
    assert lines == [f"engine at {out} is up to date (fingerprint {first.fingerprint[:12]}); "
                     f"use --force to rebuild"]
    assert build_engine(tiny_checkpoints["llama"], out, force=True)[1]
    changed, built = build_engine(tiny_checkpoints["llama"], out, tokens_per_block=32)
    assert built and changed.fingerprint != first.fingerprint and changed.kv.tokens_per_block == 32
    moved = copy_checkpoint(tiny_checkpoints["llama"], tmp_path)   # path is not in the fingerprint
    assert build_engine(moved, tmp_path / "e2")[0].fingerprint == first.fingerprint
    (moved / "generation_config.json").write_text('{"eos_token_id": [1, 2]}')
    assert build_engine(moved, tmp_path / "e2")[0].fingerprint != first.fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "e2", "engine"]  # no temp dirs


def test_bfloat16_checkpoint_reads_exactly(tiny_checkpoints, tmp_path):
    import torch
    from safetensors.torch import load_file as load_torch, save_file as save_torch

    ckpt = copy_checkpoint(tiny_checkpoints["llama"], tmp_path)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_torch(ckpt / "model.safetensors").items()}
    save_torch(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    build_engine(ckpt, tmp_path / "e")
    ours = engine_weights(tmp_path / "e")
    expected = tensors["model.layers.0.mlp.down_proj.weight"].float().numpy()
    np.testing.assert_array_equal(ours["layers.0.down.weight"], expected)


def test_float16_storage(tiny_checkpoints, tiny_engines, tmp_path):
    spec, _ = build_engine(tiny_checkpoints["qwen2"], tmp_path / "e", dtype="float16",
                           kv_dtype="float16")
    assert spec.dtype == "float16" and spec.kv.dtype == "float16"
    half, full = engine_weights(tmp_path / "e"), engine_weights(tiny_engines["qwen2"])
    assert all(w.dtype == np.float16 for w in half.values())
    np.testing.assert_allclose(half["layers.0.qkv.weight"], full["layers.0.qkv.weight"],
                               rtol=1e-3, atol=1e-4)


def test_token_ids_eos_list_and_tokenizer_config_fallback(tiny_checkpoints, tmp_path):
    ckpt = copy_checkpoint(tiny_checkpoints["llama"], tmp_path)
    (ckpt / "generation_config.json").write_text('{"eos_token_id": [2, 1]}')
    assert build_engine(ckpt, tmp_path / "a")[0].eos_token_id == 2
    (ckpt / "generation_config.json").unlink()
    config = json.loads((ckpt / "config.json").read_text())
    config.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    (ckpt / "config.json").write_text(json.dumps(config))
    spec, _ = build_engine(ckpt, tmp_path / "b")
    assert (spec.bos_token_id, spec.eos_token_id, spec.pad_token_id) == (0, 1, 2)


def _break_tensors(ckpt: Path, edit) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})


def _set_arch(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM"]
    (ckpt / "config.json").write_text(json.dumps(config))


UP = "model.layers.1.mlp.up_proj.weight"
BREAKAGES = {
    "unsupported architecture": (_set_arch, "config.json", "LlamaForCausalLM"),
    "missing config": (lambda c: (c / "config.json").unlink(), "config.json", "not found"),
    "corrupt config": (lambda c: (c / "config.json").write_text("{"), "config.json", "JSON"),
    "missing tokenizer": (lambda c: (c / "tokenizer.json").unlink(), "tokenizer.json", "not found"),
    "missing tensor": (lambda c: _break_tensors(c, lambda t: t.pop(UP)), "model.safetensors",
                       f"missing tensor '{UP}'"),
    "corrupt tokenizer": (lambda c: (c / "tokenizer.json").write_text("[1, 2"), "tokenizer.json",
                          "not a valid tokenizer.json"),
    "wrong shape": (lambda c: _break_tensors(c, lambda t: t.update(
        {"model.norm.weight": np.ones(63, np.float32)})), "model.safetensors",
        "'model.norm.weight' has shape [63], expected [64]"),
    "corrupt safetensors": (lambda c: (c / "model.safetensors").write_bytes(b"\x10" + b"x" * 40),
                            "model.safetensors", "safetensors"),
    "truncated safetensors": (lambda c: (c / "model.safetensors").write_bytes(
        (c / "model.safetensors").read_bytes()[:-100]), "model.safetensors", "truncated"),
}


@pytest.mark.parametrize("case", sorted(BREAKAGES))
def test_errors_name_the_file(case, tiny_checkpoints, tmp_path):
    breaker, filename, phrase = BREAKAGES[case]
    ckpt = copy_checkpoint(tiny_checkpoints["llama"], tmp_path)
    breaker(ckpt)
    with pytest.raises(UserError) as info:
        build_engine(ckpt, tmp_path / "engine")
    message = str(info.value)
    assert "\n" not in message and filename in message and phrase in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]      # nothing half-written


def test_bad_options_and_missing_dir(tiny_checkpoints, tmp_path):
    with pytest.raises(UserError, match="not found"):
        build_engine(tmp_path / "nope", tmp_path / "e")
    with pytest.raises(UserError, match="--tokens-per-block"):
        build_engine(tiny_checkpoints["llama"], tmp_path / "e", tokens_per_block=0)
    with pytest.raises(UserError, match="max_position_embeddings 512"):
        build_engine(tiny_checkpoints["llama"], tmp_path / "e", max_seq_len=513)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="refusing to overwrite"):
        build_engine(tiny_checkpoints["llama"], tmp_path / "busy")


def test_cli_build_and_demo(tiny_checkpoints, tmp_path, capsys):
    args = ["build", "--checkpoint", str(tiny_checkpoints["gpt2"]), "--output", str(tmp_path / "e")]
    assert main(args + ["--quiet", "--dtype", "float16"]) == 0
    assert EngineSpec.load(tmp_path / "e").dtype == "float16"
    assert capsys.readouterr().err == ""                           # --quiet
    assert main(args + ["--dtype", "float16"]) == 0
    assert "is up to date" in capsys.readouterr().err
    missing = ["build", "--checkpoint", str(tmp_path / "nope"), "--output", str(tmp_path / "x")]
    assert main(missing) == 2
    assert main(args + ["--max-batch-size", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("triton-disagg build: error:") for line in err)
    assert main(["demo-checkpoint", "--output", str(tmp_path / "demo"), "--seed", "1"]) == 0
    assert main(["demo-checkpoint", "--output", str(tmp_path / "demo"), "--seed", "1"]) == 0
    assert "already there" in capsys.readouterr().err


def test_demo_is_deterministic(demo_checkpoint, tmp_path):
    assert not write_demo_checkpoint(demo_checkpoint)          # same seed: nothing to do
    write_demo_checkpoint(tmp_path / "same", hidden_size=64, intermediate_size=96)
    write_demo_checkpoint(tmp_path / "again", hidden_size=64, intermediate_size=96)
    write_demo_checkpoint(tmp_path / "other", seed=1, hidden_size=64, intermediate_size=96)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "same" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    a = load_file(str(tmp_path / "same" / "model.safetensors"))
    b = load_file(str(tmp_path / "other" / "model.safetensors"))
    assert not np.array_equal(a["lm_head.weight"], b["lm_head.weight"])


def test_demo_loads_in_transformers_and_tokenizer_round_trips(demo_checkpoint, demo_engine):
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = EngineSpec.load(demo_engine)
    assert (spec.shape.hidden_size, spec.shape.num_layers, spec.shape.vocab_size) == \
        (256, 4, 2048)
    tok = Tokenizer.from_file(str(demo_engine / "tokenizer.json"))
    hf_tok = AutoTokenizer.from_pretrained(demo_checkpoint)
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids[0] == spec.bos_token_id and tok.decode(ids) == text
        assert hf_tok.decode(hf_tok(text).input_ids, skip_special_tokens=True) == text
    model = AutoModelForCausalLM.from_pretrained(demo_checkpoint).eval()
    prompt = torch.tensor([tok.encode(TEXTS[0]).ids])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=16, do_sample=False)
    assert len(set(out[0, prompt.shape[1]:].tolist())) > 3        # not one token repeated

"""A prompt's token ids are Hugging Face's ``tokenizer(prompt).input_ids`` (so
``usage.prompt_tokens`` is vLLM's and HF's count): the special tokens the tokenizer adds (the
demo tokenizer's post-processor adds a BOS; transformers 5 keeps a ``tokenizer.json``'s
post-processor whatever ``tokenizer_config.json``'s ``add_bos_token`` / ``add_eos_token``
say), and none added to a chat template's output, which writes its own (vLLM's
``add_special_tokens=False``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from triton_disagg.engine.spec import EngineSpec
from triton_disagg.front.tokenizer import Tokenizer
from triton_disagg.front.openai_api import parse
from triton_disagg.front.orchestrator_call import RequestEncoder

TEXTS = ["The quick brown fox", "日本語と中文的文字", "emoji 🎉🚀 party", "a", " leading space"]


def hf_ids(directory: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)(text).input_ids


def tokenizer_dir(demo_engine: Path, tmp_path: Path, post_processor: bool = True,
                  **config) -> Path:
    """The demo engine's tokenizer files, ``config`` merged into its tokenizer_config.json
    (and without tokenizer.json's post-processor unless ``post_processor``)."""
    shutil.copy(demo_engine / "tokenizer.json", tmp_path / "tokenizer.json")
    if not post_processor:
        data = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
        data["post_processor"] = None
        (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    merged = json.loads((demo_engine / "tokenizer_config.json").read_text()) | config
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(merged))
    return tmp_path


def test_the_demo_tokenizer_adds_its_bos_as_hugging_face_does(demo_engine):
    tokenizer, bos = Tokenizer(demo_engine), EngineSpec.load(demo_engine).bos_token_id
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_ids(demo_engine, text) and ids[0] == bos
        assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]


@pytest.mark.parametrize("config, post_processor", [
    ({"add_bos_token": False}, True),
    ({"add_bos_token": True, "add_eos_token": True}, True),
    ({"add_bos_token": True}, False),                        # no post-processor: nothing added
    ({}, False),
    ({"tokenizer_class": "GPT2Tokenizer", "add_bos_token": False}, True),
])
def test_tokenizer_config_flags_change_the_ids_only_as_in_transformers(
        demo_engine, tmp_path, config, post_processor):
    directory = tokenizer_dir(demo_engine, tmp_path, post_processor, **config)
    tokenizer = Tokenizer(directory)
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_ids(directory, text), (config, text)


def test_a_completion_gets_the_bos_and_a_chat_its_templates_text_only(demo_engine):
    preparer = RequestEncoder(demo_engine, "demo")
    completion = preparer.inputs(parse("completions", {"model": "demo", "prompt": TEXTS[0]}))
    assert completion["input_ids"].reshape(-1).tolist() == hf_ids(demo_engine, TEXTS[0])
    chat = parse("chat", {"model": "demo", "messages": [{"role": "user", "content": "hi"}]})
    rendered = preparer.prompt(chat)
    assert preparer.inputs(chat)["input_ids"].reshape(-1).tolist() == \
        preparer.tokenizer.encode(rendered, add_special_tokens=False)
    ids = preparer.inputs(parse("completions", {"model": "demo", "prompt": [5, 6, 7]}))
    assert ids["input_ids"].reshape(-1).tolist() == [5, 6, 7]      # token ids: as sent

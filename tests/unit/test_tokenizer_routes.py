"""vLLM's tokenizer routes on the front's app in this process (:mod:`triton_disagg.front.
tokenizer_routes`): ``GET /tokenizer_info`` with what lm-eval's remote tokenizer reads
(``eos_token``, ``bos_token``, ``chat_template``) and nothing of the tokenizer config past its
listed fields; ``POST /tokenize`` as Hugging Face's tokenizer counts; ``POST /detokenize``;
each bounded, a wrong model 404."""

from __future__ import annotations

import json
import shutil

import pytest

from scripted_relay import ScriptedRelay, run
from triton_disagg.front.orchestrator_call import MAX_CHARS_PER_TOKEN

MAX_SEQ_LEN = 2048                  # the demo engine's


@pytest.fixture(scope="module")
def engine_with_extras(demo_engine, tmp_path_factory):
    """The demo engine, its tokenizer config given a file path and an unknown key, which
    ``/tokenizer_info`` must not answer."""
    engine = tmp_path_factory.mktemp("tok") / "demo"
    shutil.copytree(demo_engine, engine)
    config_path = engine / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(vocab_file="/home/someone/private/vocab.json", auth_token="hf_secret",
                  model_max_length=10**30)
    config_path.write_text(json.dumps(config))
    return engine


def test_tokenizer_info_answers_what_lm_eval_reads_and_no_other_key(engine_with_extras):
    config = json.loads((engine_with_extras / "tokenizer_config.json").read_text())

    async def check(client):
        resp = await client.get("/tokenizer_info")
        info = await resp.json()
        assert resp.status == 200
        assert info["eos_token"] == config["eos_token"] and info["bos_token"] == config["bos_token"]
        assert info["chat_template"] == config["chat_template"]
        assert info["tokenizer_class"] == config["tokenizer_class"]
        assert info["model_max_length"] == MAX_SEQ_LEN          # the engine's, not 10**30
        assert not {"vocab_file", "auth_token"} & set(info)
        assert "hf_secret" not in json.dumps(info) and "/home/" not in json.dumps(info)
    run(ScriptedRelay([]), check, engine_with_extras)


def test_tokenize_and_detokenize_are_hugging_faces(demo_engine):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(demo_engine)
    text = "The quick brown fox 日本語 🎉"

    async def check(client):
        for special in (True, False):
            resp = await client.post("/tokenize", json={"prompt": text, "model": "demo",
                                                        "add_special_tokens": special})
            body = await resp.json()
            want = hf(text, add_special_tokens=special).input_ids
            assert resp.status == 200 and body == {"count": len(want),
                                                   "max_model_len": MAX_SEQ_LEN,
                                                   "tokens": want, "token_strs": None}
        ids = hf(text).input_ids
        resp = await client.post("/detokenize", json={"tokens": ids})
        assert (await resp.json()) == {"prompt": hf.decode(ids)}
        resp = await client.post("/detokenize", json={"tokens": []})
        assert (await resp.json()) == {"prompt": ""}
    run(ScriptedRelay([]), check, demo_engine)


@pytest.mark.parametrize("path, body, status, words", [
    ("/tokenize", {"prompt": "x" * (MAX_SEQ_LEN * MAX_CHARS_PER_TOKEN + 1)}, 400,
     ["prompt", "at most"]),
    ("/tokenize", {"prompt": ["a"]}, 400, ["prompt"]),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}]}, 400, ["messages"]),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, ["other", "demo"]),
    ("/detokenize", {"tokens": [10**9]}, 400, ["tokens", "vocabulary"]),
    ("/detokenize", {"tokens": [1] * (MAX_SEQ_LEN + 1)}, 400, ["tokens", "2049"]),
    ("/detokenize", {"tokens": "1 2"}, 400, ["tokens"]),
])
def test_bad_bodies_are_4xx_naming_the_field(demo_engine, path, body, status, words):
    async def check(client):
        resp = await client.post(path, json=body)
        error = (await resp.json())["error"]
        assert resp.status == status, error
        for word in words:
            assert word in error["message"], error
        resp = await client.post("/tokenize", json={"prompt": "a"})     # still serving
        assert resp.status == 200
    run(ScriptedRelay([]), check, demo_engine)

"""The HTTP front's request checks (:mod:`triton_disagg.front.openai_api`), its chat
template against transformers' ``apply_chat_template``, stop-sequence trimming, and the
orchestrator tensors it prepares (:mod:`triton_disagg.front.orchestrator_call`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from triton_disagg.front.chat_template import ChatTemplate
from triton_disagg.front.openai_api import ApiError, parse
from triton_disagg.front.generation_routes import StopTrimmer, finish_reason

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}


def test_completion_body_becomes_a_generation():
    gen = parse("completions", {"model": "demo", "prompt": ["日本 🎉"], "max_tokens": 7,
                                "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "x",
                                "stream": True, "stream_options": {"include_usage": True},
                                "n": 1, "user": "u"})
    assert (gen.prompt, gen.max_tokens, gen.stop, gen.stream, gen.include_usage) == \
        ("日本 🎉", 7, ("x",), True, True)
    assert gen.sampling == {"temperature": 0.0, "top_p": 0.5, "seed": 3}


def test_vllm_sampling_extensions_reach_the_engine_inputs(demo_engine):
    """vLLM's ``bench serve`` sends repetition_penalty 1.0 on every completions request;
    top_k (-1: off), min_tokens, seed go to the orchestrator under the ensemble's names."""
    from triton_disagg.front.orchestrator_call import RequestEncoder

    body = {"model": "demo", "prompt": "a", "repetition_penalty": 1.0, "top_k": -1,
            "min_tokens": 3, "seed": 7, "ignore_eos": False, "min_p": 0.0}
    gen = parse("completions", body)
    assert gen.sampling == {"temperature": 1.0, "top_k": 0, "seed": 7, "min_tokens": 3,
                            "repetition_penalty": 1.0}
    inputs = RequestEncoder(demo_engine, "demo").inputs(gen)
    assert {n: inputs[n].item() for n in gen.sampling} == gen.sampling
    assert "return_log_probs" not in inputs
    assert parse("chat", {**CHAT, "top_k": 5, "repetition_penalty": 1.3}).sampling["top_k"] == 5


def test_a_cache_salt_reaches_the_engine_and_its_router_as_utf8(demo_engine):
    """``cache_salt`` (vLLM's) goes to the orchestrator as UTF-8 BYTES; the engine request
    and the router read it back, bounded before it is decoded."""
    from triton_disagg.errors import RequestError
    from triton_disagg.front.orchestrator_call import RequestEncoder
    from triton_disagg.triton.tensors import cache_salt

    gen = parse("chat", {**CHAT, "cache_salt": "tenant-\u00e9"})
    inputs = RequestEncoder(demo_engine, "demo").inputs(gen)
    assert inputs["cache_salt"].reshape(-1)[0] == "tenant-\u00e9".encode()
    assert cache_salt({"cache_salt": inputs["cache_salt"][0]}) == "tenant-\u00e9"
    assert cache_salt({}) is None
    for raw, words in ((b"x" * 1025, "1025 bytes"), (b"\xff\xfe", "not UTF-8")):
        with pytest.raises(RequestError, match=words):
            cache_salt({"cache_salt": np.array([raw], dtype=object)})


def test_logprobs_and_echo_are_parsed_and_ask_the_engine(demo_engine):
    from triton_disagg.front.orchestrator_call import RequestEncoder

    preparer = RequestEncoder(demo_engine, "demo")
    gen = parse("completions", {"model": "demo", "prompt": "a", "logprobs": 0})
    assert gen.logprobs == 0 and preparer.inputs(gen)["return_log_probs"].item() is True
    assert parse("completions", {"model": "demo", "prompt": "a", "echo": True}).echo
    assert "prompt_logprobs" not in preparer.inputs(gen)
    # lm-eval's loglikelihood payload: the prompt's own log-probs, with an alternative each
    lm_eval = parse("completions", {"model": "demo", "prompt": [[5, 6, 7]], "temperature": 0,
                                    "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
    assert preparer.inputs(lm_eval)["prompt_logprobs"].tolist() == [[1]]
    echo_0 = parse("completions", {"model": "demo", "prompt": "a", "echo": True, "logprobs": 0})
    assert echo_0.prompt_logprobs == 0 and preparer.inputs(echo_0)["prompt_logprobs"] == 1
    assert parse("chat", {**CHAT, "logprobs": True}).logprobs == 0
    assert parse("chat", {**CHAT, "logprobs": True, "top_logprobs": 3}).logprobs == 3
    assert parse("chat", {**CHAT, "logprobs": False}).logprobs is None


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]])
def test_token_id_prompts_go_to_the_engine_as_sent(demo_engine, prompt):
    from triton_disagg.front.orchestrator_call import RequestEncoder

    preparer = RequestEncoder(demo_engine, "demo")
    gen = parse("completions", {"model": "demo", "prompt": prompt, "max_tokens": 4,
                                "stop": ["x"]}, preparer.limits)
    assert gen.prompt == (5, 6, 7)
    inputs = preparer.inputs(gen)
    assert inputs["input_ids"].tolist() == [[5, 6, 7]]
    assert inputs["input_lengths"].tolist() == [[3]]
    assert inputs["request_output_len"].tolist() == [[4]]
    assert inputs["stop_words_list"][0, 0, 0] == preparer.tokenizer.encode_word("x")[0]
    too_long = parse("completions", {"model": "demo", "prompt": [5] * (preparer.max_seq_len - 3),
                                     "max_tokens": 4}, preparer.limits)
    with pytest.raises(ApiError, match="exceeds this engine's max_seq_len") as err:
        preparer.inputs(too_long)
    assert err.value.param == "prompt"


def test_several_prompts_and_n_are_choices_in_openai_order():
    gen = parse("completions", {"model": "demo", "prompt": [[5, 6], "b"], "n": 2, "seed": 9})
    assert [(c.prompt, c.n, c.sampling["seed"]) for c in gen.choices()] == \
        [((5, 6), 1, 9), ((5, 6), 1, 10), ("b", 1, 11), ("b", 1, 12)]
    assert parse("chat", {**CHAT, "n": 3}).choices()[2].messages == parse("chat", CHAT).messages


def test_openai_defaults_temperature_one_and_inference_greedy():
    assert parse("chat", CHAT).sampling == {"temperature": 1.0}
    assert parse("inference", {"prompt": "Hello, world!", "model": "demo"}).sampling == {}


def test_ignore_eos_sends_no_end_id(demo_engine):
    from triton_disagg.front.orchestrator_call import RequestEncoder

    preparer = RequestEncoder(demo_engine, "demo")
    body = {"model": "demo", "prompt": "a"}
    inputs = preparer.inputs(parse("completions", {**body, "ignore_eos": True}))
    assert int(inputs["end_id"][0, 0]) == -1
    inputs = preparer.inputs(parse("completions", body))
    assert int(inputs["end_id"][0, 0]) == preparer.pre.eos_id >= 0


def test_max_completion_tokens_wins_over_max_tokens():
    assert parse("chat", {**CHAT, "max_tokens": 5, "max_completion_tokens": 9}).max_tokens == 9


@pytest.mark.parametrize("endpoint, body, names", [
    ("completions", [1, 2], "JSON object"),
    ("completions", {"model": "demo", "prompt": "a", "frobnicate": 1}, "'frobnicate': unknown"),
    ("completions", {"model": "demo"}, "'prompt' is required"),
    ("completions", {"model": "demo", "prompt": 5}, "'prompt': expected a string"),
    ("completions", {"model": "demo", "prompt": ["a"] * 9}, "'prompt': 9 items; at most 8"),
    ("completions", {"model": "demo", "prompt": ["a", "b"], "n": 5}, "'n': 2 prompts x n 5 is more than 8"),
    ("completions", {"model": "demo", "prompt": "a", "n": 2, "stream": True}, "'stream': one choice per streamed"),
    ("completions", {"model": "demo", "prompt": ["a", [1, "x"]]}, "'prompt[1][1]': expected an integer, got str 'x'"),
    ("completions", {"model": "demo", "prompt": "a", "max_tokens": "5"}, "'max_tokens': expected an integer"),
    ("completions", {"model": "demo", "prompt": "a", "max_tokens": 0}, "'max_tokens': 0 must be between 1 and"),
    ("completions", {"model": "demo", "prompt": "a", "max_tokens": True}, "'max_tokens': expected an integer"),
    ("completions", {"model": "demo", "prompt": "a", "temperature": 3}, "'temperature': 3 must be in [0.0, 2.0]"),
    ("completions", {"model": "demo", "prompt": "a", "top_p": 0}, "'top_p': 0 must be in (0.0, 1.0]"),
    ("completions", {"model": "demo", "prompt": "a", "n": 0}, "'n': 0 must be between 1 and 8"),
    ("completions", {"model": "demo", "prompt": "a", "logprobs": 6}, "'logprobs': 6 must be between 0 and 5"),
    ("completions", {"model": "demo", "prompt": "a", "min_p": 0.1}, "'min_p': 0.1: min_p is not supported"),
    ("completions", {"model": "demo", "prompt": "a", "repetition_penalty": 0}, "'repetition_penalty': 0 must be in (0.0"),
    ("completions", {"model": "demo", "prompt": "a", "top_k": -2}, "'top_k': -2 must be between -1 and"),
    ("completions", {"model": "demo", "prompt": "a", "min_tokens": -1}, "'min_tokens': -1 must be between 0 and"),
    ("completions", {"model": "demo", "prompt": [1, 2**40]}, "'prompt': token id 1099511627776 is not in this model's vocabulary"),
    ("completions", {"model": "demo", "prompt": [1, -1]}, "'prompt': token id -1 is not in"),
    ("completions", {"model": "demo", "prompt": [1, True]}, "'prompt[1]': expected an integer, got bool True"),
    ("completions", {"model": "demo", "prompt": [[1], [2, -5]]}, "'prompt[1]': token id -5 is not in"),
    ("completions", {"model": "demo", "prompt": []}, "'prompt': expected a non-empty list"),
    ("chat", {**CHAT, "top_logprobs": 2}, "'top_logprobs': only allowed with logprobs true"),
    ("chat", {**CHAT, "logprobs": True, "top_logprobs": 21}, "'top_logprobs': 21 must be between 0 and 20"),
    ("chat", {**CHAT, "echo": True}, "'echo': unknown field"),
    ("completions", {"model": "demo", "prompt": "a", "stop": ["a"] * 5}, "'stop': 5 items; at most 4"),
    ("completions", {"model": "demo", "prompt": "a", "stream_options": {"include_usage": True}},
     "only allowed with stream true"),
    ("completions", {"model": "demo", "prompt": "a", "stream": True,
                     "stream_options": {"x": 1}}, "'stream_options.x': unknown"),
    ("chat", {**CHAT, "tools": [{"type": "function"}]}, "'tools'"),
    ("chat", {**CHAT, "messages": []}, "'messages': expected a non-empty list"),
    ("chat", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "'messages[0].role': 'robot'"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "'messages[0].content[0].type': 'image_url' is not one of 'text'"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "'messages[0].tool_calls': unknown field"),
    ("inference", {"model": "demo"}, "'prompt' is required"),
    ("inference", {"prompt": "a", "n": 1}, "'n': unknown field"),
    ("completions", {"model": "demo", "prompt": "a", "cache_salt": ""}, "'cache_salt': expected a non-empty string"),
    ("chat", {**CHAT, "cache_salt": "x" * 257}, "'cache_salt': 257 characters; at most 256"),
    ("chat", {**CHAT, "cache_salt": 5}, "'cache_salt': expected a string, got int 5"),
    ("inference", {"prompt": "a", "cache_salt": "t"}, "'cache_salt': unknown field"),
])
def test_bad_bodies_are_400_naming_the_field(endpoint, body, names):
    with pytest.raises(ApiError) as err:
        parse(endpoint, body)
    assert err.value.status == 400 and names in str(err.value)
    assert set(err.value.body()["error"]) == {"message", "type", "param", "code"}


def test_an_unknown_fields_name_is_shown_bounded():
    with pytest.raises(ApiError) as err:
        parse("completions", {"model": "demo", "prompt": "a", "x" * 100_000: 1})
    assert err.value.status == 400 and "unknown field" in str(err.value)
    assert len(str(err.value)) < 200


def test_chat_content_parts_are_joined():
    gen = parse("chat", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert gen.messages == ({"role": "user", "content": "ab"},)


# ---- chat templates: equal to transformers' apply_chat_template -------------------------

LLAMA3_LIKE = (
    "{{ bos_token }}{% for message in messages %}{% if loop.index0 == 0 and message['role'] "
    "!= 'system' %}{{ '<|start_header_id|>system<|end_header_id|>\\n\\nBe brief.<|eot_id|>' }}"
    "{% endif %}{% if message['role'] == 'assistant' and message['content'] == '' %}"
    "{% continue %}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{{ messages | tojson }}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")
MESSAGES = [{"role": "system", "content": "You are 助手 🤖."},
            {"role": "user", "content": "  日本語と中文的文字 emoji 🎉🚀  "},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "again"}]


def _tokenizer_dir(tmp_path, template):
    from triton_disagg.builders.demo import write_demo_tokenizer

    write_demo_tokenizer(tmp_path)
    if template is not None:
        path = tmp_path / "tokenizer_config.json"
        config = json.loads(path.read_text())
        config["chat_template"] = template
        path.write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("template", [None, LLAMA3_LIKE], ids=["demo", "llama3-like"])
def test_chat_template_renders_as_transformers(tmp_path, template):
    from transformers import PreTrainedTokenizerFast

    directory = _tokenizer_dir(tmp_path, template)
    hf = PreTrainedTokenizerFast.from_pretrained(str(directory))
    want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ChatTemplate.load(directory).render(MESSAGES) == want
    assert "日本語と中文的文字" in want


def test_template_raise_exception_is_the_requests_mistake(tmp_path):
    from triton_disagg.errors import RequestError

    directory = _tokenizer_dir(tmp_path, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(RequestError, match="roles must alternate"):
        ChatTemplate.load(directory).render(MESSAGES)


def test_template_sandbox_refuses_attribute_escapes(tmp_path):
    from triton_disagg.errors import RequestError

    directory = _tokenizer_dir(tmp_path, "{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(RequestError, match="chat template"):
        ChatTemplate.load(directory).render(MESSAGES)


def test_no_template_loads_as_none(tmp_path):
    directory = _tokenizer_dir(tmp_path, None)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.load(directory) is None


# ---- stop sequences -----------------------------------------------------------------------

@pytest.mark.parametrize("deltas, stop, text, stopped", [
    (["Hel", "lo wor", "ld!"], ("world!",), "Hello ", True),
    (["Hel", "lo wor", "ld!"], ("xyz", "ld!"), "Hello wor", True),
    (["a", "b", "c"], ("zz",), "abc", False),
    (["日本", "語🎉"], ("🎉",), "日本語", True),
    (["ab"], (), "ab", False),
    (["the cat sat", " on the mat"], ("sat",), "the cat ", True),
    (["x", "yz", "q"], ("yzx",), "xyzq", False),
    (["x", "yz", "xy"], ("yzx",), "x", True),
])
def test_stop_trimmer_streams_what_the_whole_text_holds(deltas, stop, text, stopped):
    trimmer = StopTrimmer(stop)
    out = "".join(trimmer.add(d) for d in deltas) + trimmer.finish()
    assert out == text and trimmer.stopped == stopped
    assert finish_reason(trimmer, "length") == ("stop" if stopped else "length")
    assert finish_reason(StopTrimmer(()), "stop_word") == "stop"
    assert finish_reason(StopTrimmer(()), None) == "stop"     # an orchestrator that sent none


# ---- prepared tensors ---------------------------------------------------------------------

def test_prepared_inputs_have_the_orchestrator_shapes(demo_engine):
    from triton_disagg import protocol as P
    from triton_disagg.front.orchestrator_call import RequestEncoder
    from triton_disagg.triton.tensors import by_name

    preparer = RequestEncoder(demo_engine, "demo")
    gen = parse("chat", {**CHAT, "stop": ["a", "bc"], "seed": 5})
    inputs, prompt = preparer.inputs(gen), preparer.prompt(gen)
    specs = by_name(P.ORCHESTRATOR_INPUTS)
    assert set(inputs) <= set(specs)
    for name, array in inputs.items():
        assert array.dtype == specs[name].numpy_dtype, name
        assert array.shape[0] == 1 and array.ndim == len(specs[name].dims) + 1, name
    assert inputs["stop_words_list"].shape[:2] == (1, 2)
    assert bool(inputs["stream"][0, 0]) and int(inputs["seed"][0, 0]) == 5
    # chat default max_tokens: the rest of the engine's context
    assert int(inputs["request_output_len"][0, 0]) + inputs["input_ids"].shape[1] == \
        preparer.max_seq_len
    assert prompt.endswith("<|assistant|>\n")
    ids = preparer.tokenizer.encode(prompt, add_special_tokens=False)   # the template's text
    assert np.array_equal(inputs["input_ids"][0], ids)


def test_prepare_refuses_another_model_with_404_and_long_prompts_with_400(demo_engine):
    from triton_disagg.front.orchestrator_call import RequestEncoder

    preparer = RequestEncoder(demo_engine, "demo")
    with pytest.raises(ApiError) as err:
        preparer.inputs(parse("completions", {"model": "gpt-4", "prompt": "a"}))
    assert err.value.status == 404 and "'demo'" in str(err.value)
    assert err.value.body()["error"]["code"] == "model_not_found"
    with pytest.raises(ApiError) as err:        # the name is the client's: shown bounded
        preparer.inputs(parse("completions", {"model": "m" * 100_000, "prompt": "a"}))
    assert err.value.status == 404 and len(str(err.value)) < 200
    with pytest.raises(ApiError) as err:
        preparer.inputs(parse("completions", {"model": "demo", "prompt": "a",
                                              "max_tokens": preparer.max_seq_len}))
    assert err.value.status == 400 and "max_seq_len" in str(err.value)
    assert err.value.param == "prompt"       # OpenAI's: the field at fault, and a string code
    with pytest.raises(ApiError, match="max_seq_len") as err:
        preparer.inputs(parse("chat", {**CHAT, "max_tokens": 4, "messages": [
            {"role": "user", "content": "word " * preparer.max_seq_len}]}))
    assert err.value.param == "messages"
    assert err.value.body()["error"]["code"] == "invalid_request_error"


def test_token_ids_are_bounded_by_the_models_rows_when_the_tokenizer_has_more(demo_engine,
                                                                              monkeypatch):
    """A tokenizer may add tokens past the model's vocabulary: an id the model has no row for
    is the client's mistake (400 at the front), not a fault deep in the engine."""
    from triton_disagg.engine.spec import EngineSpec
    from triton_disagg.front.tokenizer import Tokenizer
    from triton_disagg.front.orchestrator_call import RequestEncoder

    rows = EngineSpec.load(demo_engine).shape.vocab_size
    monkeypatch.setattr(Tokenizer, "vocab_size", property(lambda self: rows + 5))
    assert RequestEncoder(demo_engine, "demo").limits.vocab_size == rows

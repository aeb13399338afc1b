"""The serving library without a server: detokenizing, preprocessing, engine requests.
The token path: test_token_path.py (ZeroMQ wire), test_orchestrator_tokens.py, test_decode_loop.py."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from triton_disagg import protocol as P
from triton_disagg.triton import tensors
from triton_disagg.engine.sampling import SamplingParams, from_wire, to_wire
from triton_disagg.front.tokenizer import DeltaWindows, Preprocessor, text_delta
from triton_disagg.errors import RequestError
from triton_disagg.triton.tensors import to_batched
from engine_limits import limits_spec

SPEC = limits_spec()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from triton_disagg.builders.demo import write_demo_tokenizer
    from triton_disagg.front.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("tok")
    write_demo_tokenizer(path)
    return Tokenizer(path)


@pytest.mark.parametrize("text", ["🎉🚀 party", "日本語と中文", "héllo wörld", "plain ascii"])
def test_deltas_concatenate_to_the_whole_text_for_any_chunking(tokenizer, text):
    ids = tokenizer.encode(text) * 3
    rng = random.Random(0)
    for _ in range(20):
        windows, deltas, i = DeltaWindows(), [], 0
        while i < len(ids):
            step = rng.randint(1, 3)
            window, offset = windows.next(ids[i:i + step])
            i += step
            deltas.append(text_delta(tokenizer.decode, window, offset, is_final=i >= len(ids)))
        assert "".join(deltas) == tokenizer.decode(ids)
        assert all("\ufffd" not in d for d in deltas)   # no half characters ever go out


def test_word_lists_round_trip():
    arr = to_wire([[97, 98], [99]])
    assert arr.tolist() == [[97, 98, 99], [2, 3, -1]]
    assert from_wire(arr, "stop") == ((97, 98), (99,))
    assert from_wire(to_wire([]), "stop") == ()


def test_preprocessor_defaults_and_refusals(tokenizer):
    pre = Preprocessor(tokenizer, max_seq_len=64, eos_id=1, pad_id=None, seal_key=b"k")
    out = pre.process({"text_input": np.array([b"hello"], object), "max_tokens": np.array([5])})
    assert out["input_lengths"][0] == len(out["input_ids"]) and out["end_id"][0] == 1
    assert out["pad_id"][0] == 1 and out["stop_words_list"].shape == (2, 1)
    cases = [({"max_tokens": np.array([0])}, "max_tokens"),
             ({"beam_width": np.array([2])}, "beam_width"),
             ({"text_input": np.array([b"word " * 80], object)}, "max_seq_len"),
             ({"guided_decoding_guide": np.array([b"{}"], object)}, "guided")]
    for change, word in cases:
        inputs = {"text_input": np.array([b"hello"], object), "max_tokens": np.array([5]), **change}
        with pytest.raises(RequestError, match=word):
            pre.process(inputs)


def test_engine_request_parse_maps_trtllm_names():
    inputs = {"input_ids": np.array([4, 5, 6]), "input_lengths": np.array([2]),
              "request_output_len": np.array([3]), "runtime_top_k": np.array([5]),
              "temperature": np.array([0.5]), "end_id": np.array([-1]),
              "stop_words_list": np.array([[7, 8], [2, -1]])}
    req = tensors.from_inputs(inputs, SPEC)
    assert req.prompt_ids == [4, 5] and req.params.top_k == 5 and req.params.end_id is None
    assert req.params.stop_words == ((7, 8),)
    with pytest.raises(RequestError, match="top_p"):
        tensors.from_inputs({**inputs, "runtime_top_p": np.array([2.0])}, SPEC)


# Engine inputs as a client's tensors, each sampling input away from its default, then none
EVERY_INPUT = {"input_ids": np.array([4, 5, 6, 9]), "input_lengths": np.array([3]),
               "request_output_len": np.array([7]), "end_id": np.array([2]),
               "runtime_top_k": np.array([5]), "runtime_top_p": np.array([0.75], np.float32),
               "temperature": np.array([0.3], np.float32),
               "random_seed": np.array([2**64 - 3], np.uint64), "min_tokens": np.array([2]),
               "repetition_penalty": np.array([1.1], np.float32),
               "presence_penalty": np.array([-0.4], np.float32),
               "frequency_penalty": np.array([0.2], np.float32),
               "stop_words_list": to_wire([[7, 8], [3]]), "bad_words_list": to_wire([[11]]),
               "streaming": np.array([True]), "return_log_probs": np.array([True]),
               "cache_salt": np.array(["tenant é".encode()], object),
               "prompt_logprobs": np.array([0]), "top_logprobs": np.array([3])}


def test_every_input_moves_every_sampling_option_off_its_default():
    """So that the round trip below covers every option (a new one must join EVERY_INPUT)."""
    params = tensors.from_inputs(EVERY_INPUT, SPEC).params
    defaults = SamplingParams()
    assert [f.name for f in dataclasses.fields(SamplingParams)
            if f.init and getattr(params, f.name) == getattr(defaults, f.name)] == []


@pytest.mark.parametrize("inputs", [
    EVERY_INPUT,
    {"input_ids": np.array([4]), "request_output_len": np.array([1])},
    {"input_ids": np.array([4, 5]), "request_output_len": np.array([2]), "end_id": np.array([-1]),
     "temperature": np.array([0.0], np.float32), "return_log_probs": np.array([False])}],
    ids=["every input", "none", "defaults given"])
def test_an_engine_request_made_tensors_reads_back_as_itself(inputs):
    """The orchestrator's calls carry its engine request as ``engine_tensors`` makes it: what a
    context or generation reads back is the request itself, every option included, and only
    ``ENGINE_INPUTS`` go, each in its protocol dtype."""
    request = tensors.from_inputs(inputs, SPEC)
    made = tensors.engine_tensors(request)
    specs = {spec.name: spec for spec in P.ENGINE_INPUTS}
    assert {name: arr.dtype for name, arr in made.items()} == {
        name: np.dtype(specs[name].numpy_dtype) for name in made}
    assert tensors.from_inputs(made, SPEC) == request


def test_to_batched_adds_the_batch_axis_in_protocol_dtypes():
    out = to_batched(P.CONTEXT_OUTPUTS, {"output_ids": [[1, 2]], "sequence_length": [2]})
    assert out["output_ids"].shape == (1, 1, 2) and out["output_ids"].dtype == np.int32
    assert to_batched(P.ORCHESTRATOR_OUTPUTS, {"text_output": ["é"]})["text_output"][0, 0] == "é".encode()

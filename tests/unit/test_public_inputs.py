"""Public inputs are bounded before anything is built from them (issue 27, H1 and lows):
hostile word lists, prompts and sampling options cost the engine's limits, never the
request's size; the orchestrator takes only sealed (preprocessed) requests, and its error
answers name no server."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine_limits import limits_spec
from triton_disagg import protocol as P
from triton_disagg.engine.sampling import (MAX_LIST_TOKENS, SamplingParams, SamplingParamsError,
                                           from_wire, to_wire)
from triton_disagg.errors import EngineError, GenerationLost, RequestError, Timeout
from triton_disagg.front.engine_calls import OrchestratorGate, public_message
from triton_disagg.triton import tensors

SPEC = limits_spec(max_seq_len=64, vocab_size=100)
KEY = b"k" * 32


def _hostile(columns: int) -> np.ndarray:
    """A ``[2, N]`` list whose end offsets N, 0, N, 0, ... name N/2 words of N ids each."""
    table = np.zeros((2, columns), np.int32)           # [2, N]
    table[1, 0::2], table[1, 1::2] = columns, 0
    return table


def _request(**change) -> dict[str, np.ndarray]:
    base = {"input_ids": np.array([4, 5, 6], np.int32), "input_lengths": np.array([3], np.int32),
            "request_output_len": np.array([4], np.int32), "end_id": np.array([1], np.int32),
            "pad_id": np.array([1], np.int32), "stop_words_list": to_wire([[7, 8]]),
            "bad_words_list": to_wire([])}
    return {**base, **change}


@pytest.mark.parametrize("kib", [31, 512])
def test_a_hostile_word_list_is_refused_in_microseconds(kib):
    hostile = _hostile(kib * 1024 // 8)                # [2, N] int32: 8N bytes
    began = time.perf_counter()
    with pytest.raises(RequestError, match=f"stop_words_list: {hostile.shape[1]} columns"):
        tensors.from_inputs(_request(stop_words_list=hostile), SPEC)
    assert time.perf_counter() - began < 0.01


@pytest.mark.parametrize("table, why", [
    (np.zeros((3, 4), np.int32), r"shape \[3, 4\]"),
    (np.zeros(8, np.int32), r"shape \[8\]"),
    (np.array([[1, 2, 3], [2, 1, -1]]), "increase strictly"),
    (np.array([[1, 2, 3], [2, 2, -1]]), "increase strictly"),
    (np.array([[1, 2, 3], [2, 9, -1]]), "within the 3 ids"),
    (np.array([[1.0, 2.0], [1.0, 2.0]]), "integers"),
    (np.stack([np.arange(65), np.arange(1, 66)]), "65 words, at most 64"),
    (np.array([list(range(65)), [65] + [-1] * 64]), r"stop_words_list\[0\]: 65 tokens"),
])
def test_word_lists_are_checked_by_shape_offsets_and_caps(table, why):
    with pytest.raises(ValueError, match=why):
        from_wire(table, "stop_words_list")


def test_word_lists_within_the_caps_round_trip():
    words = ((1, 2), (3,), tuple(range(10, 74)))
    assert from_wire(to_wire(words), "bad_words_list") == words
    widest = to_wire([tuple(range(16))] * 64)           # 64 words of 16: MAX_LIST_TOKENS ids
    assert widest.shape == (2, MAX_LIST_TOKENS) and len(from_wire(widest, "w")) == 64


class _Untouchable:
    """A word that must not be read: only its length may be asked."""

    def __len__(self) -> int:
        return 1

    def __iter__(self):
        raise AssertionError("a word was copied before the word count was checked")


def test_sampling_params_count_words_before_copying_them():
    with pytest.raises(SamplingParamsError, match="65 words, at most 64"):
        SamplingParams(stop_words=[_Untouchable()] * 65)


def test_a_prompt_over_the_engine_is_refused_by_its_length():
    with pytest.raises(RequestError, match="input_ids holds 64 tokens"):
        tensors.from_inputs(_request(input_ids=np.arange(64, dtype=np.int32)), SPEC)


@pytest.mark.parametrize("name, value", [("request_output_len", 65), ("min_tokens", 65),
                                         ("runtime_top_k", 101)])
def test_sampling_inputs_have_upper_bounds(name, value):
    with pytest.raises(RequestError, match=f"{name} {value} is over its bound"):
        tensors.from_inputs(_request(**{name: np.array([value], np.int32)}), SPEC)


def _orchestrator_request(**change) -> dict[str, np.ndarray]:
    request = {**_request(), "stream": np.array([True])}
    request[P.PREPROCESSED] = tensors.seal(request, KEY)
    return {**request, **change}


def test_the_orchestrator_admits_only_sealed_requests_within_the_limits():
    gate = OrchestratorGate(KEY, SPEC)
    gate.check(_orchestrator_request())
    gate.check(_orchestrator_request(runtime_top_k=np.array([5], np.int32)))   # not sealed: free
    unsealed = _orchestrator_request()
    del unsealed[P.PREPROCESSED]
    forged = _orchestrator_request(input_ids=np.array([4, 5, 7], np.int32))
    other_key = dict(_orchestrator_request(), **{P.PREPROCESSED: tensors.seal(_request(), b"x")})
    for request in (unsealed, forged, other_key):
        with pytest.raises(RequestError, match="only requests prepared by this deployment's "
                                               "preprocessing.*ensemble"):
            gate.check(request)
    too_long = _request(request_output_len=np.array([62], np.int32))
    with pytest.raises(RequestError, match="exceeds this engine's max_seq_len 64"):
        gate.check({**too_long, P.PREPROCESSED: tensors.seal(too_long, KEY)})
    hostile = _request(stop_words_list=_hostile(4096))
    with pytest.raises(RequestError, match="4096 columns"):
        gate.check({**hostile, P.PREPROCESSED: tensors.seal(hostile, KEY)})


@pytest.mark.parametrize("error, words", [
    (GenerationLost("http://10.0.0.7:8001", "UNAVAILABLE: Connection refused"), "unavailable"),
    (Timeout("context server 10.0.0.7:8001 (no answer within 4 s)"), "timed out"),
    (EngineError("prefill failed: ValueError at /opt/engine/x.py"), "internal error"),
    (KeyError("settings"), "internal error"),
])
def test_error_answers_name_the_kind_and_request_but_no_server(error, words):
    message = public_message(error, "req-1")
    assert words in message and "req-1" in message, message
    assert "10.0.0.7" not in message and "/opt" not in message and "settings" not in message


def test_a_request_mistake_is_answered_as_it_is():
    assert public_message(RequestError("max_tokens must be >= 1"), "r") == "max_tokens must be >= 1"

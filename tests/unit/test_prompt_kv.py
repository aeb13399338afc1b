"""Where a generation request's prompt KV comes from (``DecodeAdmission.prompt_kv``) and how
``add`` queues it: each request type's source, the listener an overlapped request's answer
carries, the first token split off a ``generation_only`` prompt, and the refusals, against
an engine and a connector that record what they are asked."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from triton_disagg import protocol as P
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.engine.sequence import EngineRequest
from triton_disagg.errors import RequestError
from triton_disagg.generation.decode_loop import DecodeAdmission, FetchedKV, PulledKV

PARAMS = SamplingParams(max_tokens=4)
HANDLE_TOKENS = 3


class RecordingEngine:
    """The engine calls of admission, recorded: (request id, prompt ids, first token, kv)."""

    def __init__(self, cached: int = 0):
        self.cached, self.added = cached, []

    def blocks_needed(self, request_id, num_prompt_tokens, params) -> int:
        return 1

    def cached_prompt_tokens(self, prompt_ids, cache_salt) -> int:
        return self.cached

    def add_request(self, request_id, prompt_ids, params) -> None:
        self.added.append((request_id, list(prompt_ids), None, None))

    def add_prefilled(self, request_id, prompt_ids, first_token, params, kv) -> None:
        self.added.append((request_id, list(prompt_ids), first_token, kv))


class ListeningConnector:
    """A connector that listens under one nonce and decodes any handle as 3 tokens."""

    def listen(self, num_tokens: int) -> tuple[str, bytes]:
        return "nonce-1", b"listener-bytes"

    def decode(self, data: bytes):
        return SimpleNamespace(num_tokens=HANDLE_TOKENS)


def _request(ids: list[int]) -> EngineRequest:
    return EngineRequest(ids, PARAMS, streaming=True)


def test_an_overlapped_request_listens_and_takes_its_first_token_with_the_kv():
    engine = RecordingEngine()
    side = DecodeAdmission(engine, ListeningConnector())
    request = _request([5, 6, 7])
    kv = side.prompt_kv(P.GENERATION_AWAITING_CONTEXT, request, {})
    assert isinstance(kv, PulledKV) and kv.listener == b"listener-bytes"
    assert (kv.nonce, kv.num_tokens) == ("nonce-1", 3)
    side.add("pulled", request, kv)
    assert engine.added == [("pulled", [5, 6, 7], None, kv)]


def test_a_handed_off_request_fetches_its_prompt_and_keeps_the_contexts_first_token():
    engine = RecordingEngine()
    side = DecodeAdmission(engine, ListeningConnector())
    inputs = {P.CONTEXT_PHASE_PARAMS: np.frombuffer(b"handle", np.uint8)}
    request = _request([5, 6, 7, 42])
    kv = side.prompt_kv(P.GENERATION_ONLY, request, inputs)
    assert isinstance(kv, FetchedKV) and kv.listener == b""
    side.add("fetched", request, kv)
    assert engine.added == [("fetched", [5, 6, 7], 42, kv)]
    with pytest.raises(RequestError, match="plus the first generated token, got 3 ids"):
        side.prompt_kv(P.GENERATION_ONLY, _request([5, 6, 7]), inputs)
    with pytest.raises(RequestError, match="needs context_phase_params"):
        side.prompt_kv(P.GENERATION_ONLY, request, {})


def test_input_ids_longer_than_the_kv_and_one_first_token_are_refused(demo_engine):
    from triton_disagg.engine.llm_engine import LLMEngine

    side = DecodeAdmission(LLMEngine(demo_engine, num_blocks=16), ListeningConnector())
    kv = FetchedKV(side.connector, SimpleNamespace(num_tokens=HANDLE_TOKENS))
    with pytest.raises(RequestError, match="its prompt has 5 tokens but the KV to fetch holds 3"):
        side.add("longer", _request([5, 6, 7, 42, 43]), kv)
    assert side.engine.pool.num_used == 0


@pytest.mark.parametrize("request_type", [P.CONTEXT_AND_GENERATION,
                                          P.CONTEXT_AND_GENERATION_IF_CACHED])
def test_a_request_prefilled_here_has_no_remote_kv(request_type):
    engine = RecordingEngine()
    side = DecodeAdmission(engine, None)          # aggregated: no connector
    request = _request([5, 6, 7])
    assert side.prompt_kv(request_type, request, {}) is None
    side.add("local", request, None)
    assert engine.added == [("local", [5, 6, 7], None, None)]


def test_only_an_if_cached_request_with_too_much_uncached_is_declined():
    side = DecodeAdmission(RecordingEngine(cached=2), None, local_prefill=1)
    request = _request([5, 6, 7, 8])                      # 2 of 4 tokens not cached
    assert side.declines(P.CONTEXT_AND_GENERATION_IF_CACHED, request)
    assert not side.declines(P.CONTEXT_AND_GENERATION, request)
    side.local_prefill = 2
    assert not side.declines(P.CONTEXT_AND_GENERATION_IF_CACHED, request)


def test_what_generation_does_not_serve_is_refused_by_name():
    with pytest.raises(RequestError, match="send 'context_only' to the context model"):
        DecodeAdmission(RecordingEngine(), ListeningConnector()).prompt_kv(
            P.CONTEXT_ONLY, _request([5]), {})
    with pytest.raises(RequestError, match="aggregated mode"):
        DecodeAdmission(RecordingEngine(), None).prompt_kv(
            P.GENERATION_AWAITING_CONTEXT, _request([5]), {})

"""The serving library without a server: detokenizing, preprocessing, the orchestrator's
control flow (fake transport) and the generation decode loop (real engine)."""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest

from triton_disagg import protocol as P
from triton_disagg.serving import engine_request
from triton_disagg.serving.decode_loop import DecodeLoop
from triton_disagg.serving.detokenize import DeltaWindows, text_delta
from triton_disagg.serving.generation import GenerationSide
from triton_disagg.serving.orchestrator import EngineError, Orchestrator
from triton_disagg.serving.preprocess import Preprocessor, parse_word_list, word_list
from triton_disagg.serving.tensors import RequestError, to_batched


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from triton_disagg.builders.demo import write_demo_tokenizer
    from triton_disagg.engine.tokenizer import Tokenizer

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
    arr = word_list([[97, 98], [99]])
    assert arr.tolist() == [[97, 98, 99], [2, 3, -1]]
    assert parse_word_list(arr) == [[97, 98], [99]]
    assert parse_word_list(word_list([])) == []


def test_preprocessor_defaults_and_refusals(tokenizer):
    pre = Preprocessor(tokenizer, max_seq_len=64, eos_id=1, pad_id=None)
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
    req = engine_request.parse(inputs)
    assert req.prompt_ids == [4, 5] and req.params.top_k == 5 and req.params.end_id is None
    assert req.params.stop_words == ((7, 8),)
    with pytest.raises(RequestError, match="top_p"):
        engine_request.parse({**inputs, "runtime_top_p": np.array([2.0])})


def test_to_batched_adds_the_batch_axis_in_protocol_dtypes():
    out = to_batched(P.ORCHESTRATOR_OUTPUTS, {"output_ids": [1, 2], "is_final": [True]})
    assert out["output_ids"].shape == (1, 2) and out["output_ids"].dtype == np.int32
    assert to_batched(P.POSTPROCESS_OUTPUTS, {"text_output": ["é"]})["text_output"][0, 0] == "é".encode()


class FakeTransport:
    def __init__(self, first, rest, finish_last=True):
        self.first, self.rest, self.finish_last = first, rest, finish_last
        self.stopped, self.generate_calls = [], []

    @staticmethod
    def chunk(token, reason=""):
        return engine_request.outputs([token], [-0.5], -0.5, reason)

    async def context(self, request_id, inputs):
        out = self.chunk(self.first, "length" if not self.rest else "")
        out[P.CONTEXT_PHASE_PARAMS] = np.frombuffer(b"handle", np.uint8)
        return out

    async def generate(self, request_id, inputs, request_type):
        self.generate_calls.append((request_type, inputs["input_ids"].tolist()))
        for i, token in enumerate(self.rest):
            last = i == len(self.rest) - 1 and self.finish_last
            yield self.chunk(token, "stop" if last else "")

    async def stop(self, request_id):
        self.stopped.append(request_id)


def _serve(transport, mode="disaggregated", stream=True, cancel_after=None):
    sends = []

    async def send(outputs, final):
        sends.append((outputs, final))

    inputs = {"input_ids": np.array([3, 4], np.int32), "end_id": np.array([1], np.int32),
              "stream": np.array([stream])}
    cancelled = lambda: cancel_after is not None and len(sends) >= cancel_after  # noqa: E731
    outcome = asyncio.run(Orchestrator(transport, mode).handle(inputs, send, cancelled))
    return outcome, sends


def test_orchestrator_streams_first_token_then_generation():
    transport = FakeTransport(10, [11, 12, 1])
    outcome, sends = _serve(transport)
    assert outcome == "finished" and [f for _, f in sends] == [False, False, False, True]
    assert transport.generate_calls == [(P.GENERATION_ONLY, [3, 4, 10])]
    ids = [o["output_ids"][o["output_offset"][0]:].tolist() for o, _ in sends]
    assert ids == [[10], [11], [12], []]                   # the end id is not output
    assert sends[-1][0]["num_output_tokens"][0] == 3


def test_orchestrator_non_streaming_sends_exactly_one_response():
    outcome, sends = _serve(FakeTransport(10, [11, 12, 1]), stream=False)
    assert len(sends) == 1 and sends[0][1] and sends[0][0]["output_ids"].tolist() == [10, 11, 12]


def test_orchestrator_first_token_only_and_aggregated():
    transport = FakeTransport(10, [])
    assert _serve(transport)[0] == "finished" and transport.generate_calls == []
    transport = FakeTransport(10, [11, 1])
    _serve(transport, mode="aggregated")
    assert transport.generate_calls == [(P.CONTEXT_AND_GENERATION, [3, 4])]


def test_orchestrator_cancel_stops_generation(monkeypatch):
    from triton_disagg.serving import orchestrator

    monkeypatch.setattr(orchestrator, "CANCEL_POLL_SECONDS", 0.0)   # ask at every chunk
    transport = FakeTransport(10, [11, 12, 13, 14, 1])
    outcome, sends = _serve(transport, cancel_after=2)
    assert outcome == "cancelled" and len(transport.stopped) == 1 and sends[-1] == (None, True)


def test_orchestrator_stream_without_finish_is_an_error():
    with pytest.raises(EngineError):
        _serve(FakeTransport(10, [11, 12], finish_last=False))


@pytest.fixture(scope="module")
def engine(demo_engine):
    from triton_disagg.engine.llm_engine import LLMEngine

    return LLMEngine(demo_engine, num_blocks=256)


def test_decode_loop_batches_and_ends_every_request_once(engine):
    from triton_disagg.engine.sampling import SamplingParams

    side = GenerationSide(engine, {"mode": "aggregated"}, "generation_0_0")
    done = threading.Event()
    emits: dict[str, list] = {}

    def emit(sender, outputs, final, error):
        emits.setdefault(sender, []).append((outputs, final, error))
        if sum(1 for v in emits.values() for e in v if e[1]) == 4:
            done.set()

    loop = DecodeLoop(engine, emit, side)
    prompts = {f"r{i}": [5 + i, 6, 7] for i in range(3)}
    for rid, prompt in prompts.items():
        request = engine_request.EngineRequest(prompt, SamplingParams(max_tokens=8), streaming=True)
        loop.submit(rid, side.prepare(P.CONTEXT_AND_GENERATION, request, {}), rid)
    long = engine_request.EngineRequest([9, 9], SamplingParams(max_tokens=500), streaming=False)
    loop.submit("long", side.prepare(P.CONTEXT_AND_GENERATION, long, {}), "long")
    loop.stop("long")
    assert done.wait(60)
    loop.close()
    offline = engine.generate(list(prompts.values()), SamplingParams(max_tokens=8))
    for (rid, _), seq in zip(prompts.items(), offline):
        tokens = [t for out, _, _ in emits[rid] for t in out["output_ids"][0].tolist()]
        assert tokens == seq.output_ids and [f for _, f, _ in emits[rid]].count(True) == 1
        # No log-probs asked for, so none are sent; the finish reason only comes at the end.
        assert not any("output_log_probs" in out or "cum_log_probs" in out
                       for out, _, _ in emits[rid])
        assert ["finish_reason" in out for out, _, _ in emits[rid]] == \
            [final for _, final, _ in emits[rid]]
    assert emits["long"][-1][0]["finish_reason"][0] == b"cancelled"
    assert engine.pool.num_used == 0


def test_stream_interval_groups_tokens_after_the_first(engine):
    from triton_disagg.engine.sampling import SamplingParams

    side = GenerationSide(engine, {"mode": "aggregated"}, "generation_0_0")
    emits: list = []
    done = threading.Event()

    def emit(sender, outputs, final, error):
        emits.append((outputs["output_ids"][0].tolist(), final))
        if final:
            done.set()

    loop = DecodeLoop(engine, emit, side, stream_interval=3)
    request = engine_request.EngineRequest([5, 6, 7], SamplingParams(max_tokens=9), streaming=True)
    loop.submit("r", side.prepare(P.CONTEXT_AND_GENERATION, request, {}), "r")
    assert done.wait(60)
    loop.close()
    # 9 tokens: the first at once, then groups of 3, the last 2 with the final emit.
    assert [len(ids) for ids, _ in emits] == [1, 3, 3, 2]
    assert [final for _, final in emits] == [False, False, False, True]
    offline = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=9))[0].output_ids
    assert [t for ids, _ in emits for t in ids] == offline and engine.pool.num_used == 0


def test_a_stop_posted_by_another_instance_reaches_the_loop_holding_the_request(engine, tmp_path):
    from triton_disagg.engine.sampling import SamplingParams
    from triton_disagg.serving.stop_registry import StopRegistry

    side = GenerationSide(engine, {"mode": "aggregated"}, "generation_0_0")
    finals: list = []
    done = threading.Event()

    def emit(sender, outputs, final, error):
        if final:
            finals.append(outputs["finish_reason"][0])
            done.set()

    holder = DecodeLoop(engine, emit, side, stops=StopRegistry(tmp_path / "stops"))
    # The other instance holds nothing (it never steps: no live request of its own).
    other = DecodeLoop(engine, emit, side, stops=StopRegistry(tmp_path / "stops"))
    request = engine_request.EngineRequest([5, 6, 7], SamplingParams(max_tokens=500),
                                           streaming=False)
    holder.submit("r", side.prepare(P.CONTEXT_AND_GENERATION, request, {}), "r")
    other.stop("r")                        # the other instance does not hold "r": it posts
    assert done.wait(60)
    holder.close()
    other.close()
    assert finals == [b"cancelled"] and engine.pool.num_used == 0
    assert not list((tmp_path / "stops").iterdir())       # the holder took the mark


def test_stop_marks_are_taken_once_and_stale_ones_pruned(tmp_path, monkeypatch):
    from triton_disagg.serving import stop_registry
    from triton_disagg.serving.stop_registry import StopRegistry

    a, b = StopRegistry(tmp_path), StopRegistry(tmp_path)
    a.post("req-1")
    assert b.take("req-1") and not a.take("req-1") and not b.take("req-2")
    a.post("old")
    monkeypatch.setattr(stop_registry, "STALE_SECONDS", -1.0)   # everything is stale now
    b.post("new")
    assert not a.take("old") and a.take("new")


def test_merged_outputs_keep_every_token_in_order():
    def out(ids, reason=""):
        return engine_request.outputs(ids, [0.5] * len(ids), 0.5 * ids[-1], reason)

    merged = engine_request.merge_outputs(out([1]), out([2, 3], "length"))
    assert merged["output_ids"].tolist() == [[1, 2, 3]] and merged["sequence_length"][0] == 3
    assert merged["output_log_probs"].shape == (1, 3) and merged["cum_log_probs"][0] == 1.5
    assert merged["finish_reason"][0] == b"length"
    lean = engine_request.merge_outputs(
        engine_request.outputs([1], [None], 0.0, None, with_log_probs=False),
        engine_request.outputs([2], [None], 0.0, None, with_log_probs=False))
    assert lean.keys() == {"output_ids", "sequence_length"}
    assert lean["output_ids"].tolist() == [[1, 2]] and lean["sequence_length"][0] == 2


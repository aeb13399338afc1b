"""A generated token's top-N alternatives on their way from the engine to the client,
without a server: the token wire's ``top``, the orchestrator's TOP_LOGPROBS tensors, the
front's request tensors and OpenAI's objects (completions' ``top_logprobs`` dicts, chat's
``{token, logprob, bytes}`` lists), whole and streamed. Through a real server:
tests/server/test_top_logprobs_sdk.py."""

from __future__ import annotations

import asyncio
import json

import msgpack
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from triton_disagg import token_wire
from triton_disagg.engine.logprobs import TopLogprobs
from triton_disagg.front.engine_calls import ResponseBuilder
from triton_disagg.front.http_front import make_app
from triton_disagg.front.openai_api import parse
from triton_disagg.front.orchestrator_call import RequestEncoder
from triton_disagg.engine.sequence import EngineRequest, TokenEvent
from triton_disagg.token_wire import WireError
from triton_disagg.triton import tensors
from triton_disagg.triton.tensors import engine_event

A, B, C = TopLogprobs([4, 9], [-0.25, -1.5]), TopLogprobs([9, 4], [-0.5, -1.0]), \
    TopLogprobs([1, 4], [-0.1, -3.0])


# ---- the engine's request ---------------------------------------------------------------

@pytest.mark.parametrize("k, error", [(20, None), (21, "top_logprobs must be an integer in"),
                                      (-1, "top_logprobs")])
def test_an_engine_request_bounds_top_logprobs_at_20(demo_engine, k, error):
    from triton_disagg.engine.spec import EngineSpec
    from triton_disagg.errors import RequestError

    inputs = {"input_ids": np.array([5, 6]), "request_output_len": np.array([2]),
              "return_log_probs": np.array([True]), "top_logprobs": np.array([k], np.int32)}
    if error is None:
        params = tensors.from_inputs(inputs, EngineSpec.load(demo_engine)).params
        assert params.top_logprobs == k
        return
    with pytest.raises(RequestError, match=error):
        tensors.from_inputs(inputs, EngineSpec.load(demo_engine))


# ---- the token wire ---------------------------------------------------------------------

def test_alternatives_cross_the_wire_one_pair_per_token():
    events = [TokenEvent("a", [4, 9], [-0.25, -0.5], seq=1, key="k", top=[A, B]),
              TokenEvent("b", [5], [-1.0], key="k")]       # asked for none
    frame = token_wire.encode_events(events)
    assert msgpack.unpackb(frame)["events"][0]["top"] == [[[4, 9], [-0.25, -1.5]],
                                                          [[9, 4], [-0.5, -1.0]]]
    assert "top" not in msgpack.unpackb(frame)["events"][1]
    assert token_wire.decode_events(frame) == events
    merged = TokenEvent.joined([events[0],
                                TokenEvent("a", [1], [-0.1], "length", key="k", top=[C])])
    assert merged.top == [A, B, C] and merged.tokens == [4, 9, 1]


@pytest.mark.parametrize("top", [
    [[[4], [-0.5]]],                                   # one pair for two tokens
    [[[4], [-0.5]], [[4, 5], [-0.5, -1.0]]],           # rows of different lengths
    [[[4, 5], [-0.5]], [[4], [-0.5]]],                 # ids and log-probs differ in length
    [[["x"], [-0.5]], [[4], [-0.5]]],                  # an id that is not an integer
    [[[4], ["x"]], [[4], [-0.5]]],
    [[list(range(21)), [-1.0] * 21]] * 2,              # more than MAX_LOGPROBS
    "top",
])
def test_a_malformed_top_is_refused(top):
    frame = msgpack.packb({"v": 3, "events": [{"request_id": "a", "key": "k", "seq": 0,
                                               "tokens": [4, 5], "top": top}]})
    with pytest.raises(WireError, match="'top'"):
        token_wire.decode_events(frame)


def test_generation_sends_each_tokens_alternatives_in_its_events(demo_engine):
    """A request served whole by generation (aggregated, or a local prefill): every token's
    alternatives, the first's included, ride its events, grouped by stream_interval."""
    import zmq

    from triton_disagg.engine.llm_engine import LLMEngine
    from triton_disagg.engine.sampling import SamplingParams
    from triton_disagg.generation.decode_loop import DecodeAdmission, DecodeLoop
    from triton_disagg.token_wire import TokenOutbox
    from triton_disagg.zmq_endpoints import bind

    engine = LLMEngine(demo_engine, num_blocks=64)
    params = SamplingParams(max_tokens=7, return_log_probs=True, top_logprobs=3)
    side, context = DecodeAdmission(engine, None), zmq.Context.instance()
    sock = context.socket(zmq.PULL)
    endpoint = bind(sock, None, "tokens")
    loop = DecodeLoop(engine, TokenOutbox(context), side, stream_interval=3)
    request = EngineRequest([5, 6, 7], params, True)
    loop.submit("r", request, token_wire.with_key(endpoint.address, "k"))
    events = []
    while not (events and events[-1].final):
        assert sock.poll(60_000)
        events += token_wire.decode_events(sock.recv())
    loop.close()
    sock.close(linger=0)
    endpoint.release()
    assert [len(e.tokens) for e in events] == [1, 3, 3]
    assert all(len(e.top) == len(e.tokens) for e in events)
    want = []
    engine.add_request("want", [5, 6, 7], params)
    while engine.has_unfinished():
        want += engine.step()
    assert [t for e in events for t in e.top] == [t for w in want for t in w.top]


# ---- the orchestrator's tensors ---------------------------------------------------------

def test_top_tensors_of_no_alternatives_are_no_rows():
    from triton_disagg.triton.tensors import top_rows

    empty = {"output_top_ids": np.zeros((1, 0, 0), np.int32),          # [1, n=0, k=0]
             "output_top_log_probs": np.zeros((1, 0, 0), np.float32)}
    assert top_rows(empty, 0) == []


def test_the_orchestrator_sends_each_tokens_alternatives_with_its_id():
    inputs = {"input_ids": np.array([3, 4]), "end_id": np.array([1]),
              "stream": np.array([True]), "return_log_probs": np.array([True])}
    first = engine_event("r", tensors.outputs([4], [-0.25], -0.25, None, top=[A]))
    assert first.top == [A]
    builder = ResponseBuilder(inputs, lambda ids: "".join(chr(97 + i % 26) for i in ids))
    out = builder.add(first)
    assert out["output_top_ids"].tolist() == [[[4, 9]]]                        # [1, n, k]
    out = builder.add(TokenEvent("r", [9, 1], [-0.5, -0.1], finish_reason="stop",
                                  top=[B, C]))
    assert out["output_ids"].tolist() == [[9]]         # the end token is not output, nor its row
    assert out["output_top_ids"].tolist() == [[[9, 4]]]
    np.testing.assert_allclose(out["output_top_log_probs"], [[[-0.5, -1.0]]])
    quiet = ResponseBuilder({**inputs, "return_log_probs": np.array([False])}, str)
    assert "output_top_ids" not in quiet.add(TokenEvent("r", [9], [-0.5], top=[B]))


# ---- the front --------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint, body, asked", [
    ("completions", {"prompt": "a", "logprobs": 3}, 3),
    ("completions", {"prompt": "a", "logprobs": 0}, None),
    ("chat", {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
              "top_logprobs": 20}, 20),
    ("chat", {"messages": [{"role": "user", "content": "a"}], "logprobs": True}, None),
])
def test_the_front_asks_the_engine_for_the_alternatives_the_client_asked(
        demo_engine, endpoint, body, asked):
    inputs = RequestEncoder(demo_engine, "demo").inputs(parse(endpoint, {"model": "demo", **body}))
    assert inputs["return_log_probs"].tolist() == [[True]]
    assert (inputs["top_logprobs"].tolist() == [[asked]] if asked
            else "top_logprobs" not in inputs)


class Relay:
    """Answers every request with ``deltas``."""

    def __init__(self, deltas):
        self.deltas = deltas

    async def ready(self):
        return None

    async def stream(self, inputs, request_id):
        for delta in self.deltas:
            yield delta

    async def close(self):
        pass


DELTAS = [TokenEvent("", [4], [-0.25], top=[A], text="x", prompt_tokens=3, completion_tokens=1),
          TokenEvent("", [9, 1], [-0.5, -0.1], "length", top=[B, C], text="y",
                     prompt_tokens=3, completion_tokens=3)]


def post(demo_engine, path: str, body: dict):
    async def main():
        app = make_app(RequestEncoder(demo_engine, "demo"), Relay(DELTAS))
        async with TestClient(TestServer(app)) as client:
            resp = await client.post(path, json={"model": "demo", "max_tokens": 3, **body})
            return resp.status, await resp.text()
    return asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_completions_top_logprobs_map_the_chosen_and_n_most_likely_tokens(demo_engine, stream):
    text = RequestEncoder(demo_engine, "demo").token_text
    status, raw = post(demo_engine, "/v1/completions",
                       {"prompt": "a", "logprobs": 2, "stream": stream})
    assert status == 200
    bodies = ([json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")]
              if stream else [json.loads(raw)])
    tops = [t for b in bodies for c in b["choices"] if c["logprobs"]
            for t in c["logprobs"]["top_logprobs"]]
    assert len({text(1), text(4), text(9)}) == 3
    assert tops == [{text(4): -0.25, text(9): -1.5}, {text(9): -0.5, text(4): -1.0},
                    {text(1): -0.1, text(4): -3.0}]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_list_the_n_most_likely_tokens(demo_engine, stream):
    text = RequestEncoder(demo_engine, "demo").token_text
    status, raw = post(demo_engine, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
                        "top_logprobs": 2, "stream": stream})
    assert status == 200
    bodies = ([json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")]
              if stream else [json.loads(raw)])
    content = [e for b in bodies for c in b["choices"] if c["logprobs"]
               for e in c["logprobs"]["content"]]
    assert [e["token"] for e in content] == [text(4), text(9), text(1)]
    assert content[1]["top_logprobs"] == [
        {"token": text(i), "logprob": lp, "bytes": list(text(i).encode())}
        for i, lp in ((9, -0.5), (4, -1.0))]
    assert [len(e["top_logprobs"]) for e in content] == [2, 2, 2]

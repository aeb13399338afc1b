"""The HTTP front's aiohttp app in this process, its relay replaced by a scripted one (the
real relay against a real tritonserver: tests/server/test_http_front.py): error JSON for
every failure, the request id, health, a stream that fails part-way, and a client that
leaves cancelling its relay stream."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from triton_disagg.front.http_front import MAX_BODY_BYTES, make_app
from triton_disagg.front.openai_api import ApiError
from triton_disagg.front.prepare import RequestEncoder
from triton_disagg.errors import ErrorCode
from triton_disagg.front.relay import Delta, OrchestratorError


class ScriptedRelay:
    """Answers every request with ``deltas`` (a Delta, or an exception to raise there),
    one every ``pause`` s; records the request ids and whether each stream was left early."""

    def __init__(self, deltas, pause: float = 0.0, ready: str | None = None):
        self.deltas, self.pause, self.why_not_ready = deltas, pause, ready
        self.request_ids: list[str] = []
        self.left_early: list[bool] = []

    async def ready(self):
        return self.why_not_ready

    async def stream(self, inputs, request_id):
        self.request_ids.append(request_id)
        ended = False
        try:
            for item in self.deltas:
                await asyncio.sleep(self.pause)
                if isinstance(item, Exception):
                    raise item
                yield item
            ended = True
        finally:
            self.left_early.append(not ended)

    async def close(self):
        pass

    async def until_left(self, seconds: float = 15.0) -> None:
        """Wait until a stream was left early (asserted: exactly one)."""
        for _ in range(int(seconds / 0.05)):
            if self.left_early:
                break
            await asyncio.sleep(0.05)
        assert self.left_early == [True]


WORDS = [Delta("Hello", 3, 1), Delta(" 世界", 3, 2), Delta(" 🎉", 3, 3, finish_reason="length")]


def run(relay, check, demo_engine):
    async def main():
        app = make_app(RequestEncoder(demo_engine, "demo"), relay)
        async with TestClient(TestServer(app, handler_cancellation=True)) as client:
            await check(client)
    asyncio.run(main())


def test_whole_and_streamed_completion(demo_engine):
    relay = ScriptedRelay(WORDS)

    async def check(client):
        resp = await client.post("/v1/completions", json={"model": "demo", "prompt": "a",
                                                          "max_tokens": 3},
                                 headers={"X-Request-Id": "req-7"})
        body = await resp.json()
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "req-7"
        assert body["choices"][0]["text"] == "Hello 世界 🎉"
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        resp = await client.post("/v1/chat/completions", json={
            "model": "demo", "messages": [{"role": "user", "content": "a"}], "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}})
        lines = [l for l in (await resp.text()).split("\n\n") if l]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(l[len("data: "):]) for l in lines[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == "Hello 世界 🎉"
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"  # as given, not counted
        assert chunks[-1]["usage"]["completion_tokens"] == 3
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1])   # OpenAI's null
        assert len(relay.request_ids[1]) == 32            # none sent: one generated
    run(relay, check, demo_engine)


@pytest.mark.parametrize("given, tokens, openai", [
    ("stop", 3, "stop"),             # the end token as the last of max_tokens: not "length"
    ("length", 2, "length"),         # max_tokens told by the server, not counted here
    ("stop_word", 3, "stop"),
    ("cancelled", 1, "abort"),       # generation stopped it (vLLM's word)
])
def test_the_finish_reason_is_the_orchestrators_in_openais_words(demo_engine, given, tokens,
                                                                 openai):
    relay = ScriptedRelay([Delta("Hello", 3, tokens, finish_reason=given)])

    async def check(client):
        for stream in (False, True):
            resp = await client.post("/v1/completions", json={
                "model": "demo", "prompt": "a", "max_tokens": 3, "stream": stream})
            text = await resp.text()
            assert resp.status == 200 and f'"finish_reason": "{openai}"' in text, text
    run(relay, check, demo_engine)


@pytest.mark.parametrize("send, status, words", [
    (dict(data=b"{not json"), 400, "not valid JSON"),
    (dict(data=b"\xff\xfe"), 400, "not UTF-8"),
    (dict(json={"model": "demo", "prompt": "a", "max_tokens": "9"}), 400, "'max_tokens'"),
    (dict(json={"model": "demo", "prompt": "a", "best_of": 3}), 400, "'best_of'"),
    (dict(json={"model": "other", "prompt": "a"}), 404, "'other' not found"),
    (dict(data=b" " * (MAX_BODY_BYTES + 1)), 413, "over"),
])
def test_bad_requests_get_openai_error_json_and_the_server_serves_on(demo_engine, send, status,
                                                                     words):
    relay = ScriptedRelay(WORDS)

    async def check(client):
        resp = await client.post("/v1/completions", **send)
        body = await resp.json()
        assert resp.status == status and words in body["error"]["message"], body
        assert body["error"]["code"] == ("model_not_found" if status == 404
                                         else "invalid_request_error")   # OpenAI's strings
        ok = await client.post("/v1/completions", json={"model": "demo", "prompt": "a"})
        assert ok.status == 200
    run(relay, check, demo_engine)


def test_unknown_path_and_method_are_openai_errors(demo_engine):
    async def check(client):
        for resp, status in ((await client.get("/v1/nothing"), 404),
                             (await client.get("/v1/completions"), 405)):
            assert resp.status == status
            assert (await resp.json())["error"]["code"] == "invalid_request_error"
    run(ScriptedRelay(WORDS), check, demo_engine)


# Each message says something else than its code: the status follows the code.
@pytest.mark.parametrize("error, status", [
    (OrchestratorError("internal error: ValueError: x", ErrorCode.UNAVAILABLE), 503),
    (OrchestratorError("no server: lost, not ready, unavailable, busy, stalled",
                       ErrorCode.INTERNAL), 500),
    (OrchestratorError("a server this request needs is unavailable now; retry later",
                       ErrorCode.TIMEOUT), 504),
])
def test_server_faults_are_5xx_by_their_code_not_their_words(demo_engine, error, status):
    async def check(client):
        resp = await client.post("/v1/completions", json={"model": "demo", "prompt": "a"})
        assert resp.status == status
        assert (await resp.json())["error"]["type"] == "server_error"
        assert ("Retry-After" in resp.headers) == (status == 503)
    run(ScriptedRelay([error]), check, demo_engine)


def test_the_orchestrators_invalid_arg_is_a_400_with_its_message_whatever_it_says(demo_engine):
    words = "prompt is unavailable: no server timed out, busy (lost)"
    relay = ScriptedRelay([OrchestratorError(words, ErrorCode.INVALID_ARG)],
                          ready="tritonserver is not ready")

    async def check(client):
        resp = await client.post("/v1/completions", json={"model": "demo", "prompt": "a"})
        body = await resp.json()
        assert resp.status == 400 and body["error"]["message"] == words, body
        assert body["error"]["type"] == "invalid_request_error"
    run(relay, check, demo_engine)


def test_a_request_while_not_ready_is_503_with_the_reason(demo_engine):
    relay = ScriptedRelay([OrchestratorError("Request for unknown model: 'orchestrator'",
                                             ErrorCode.UNAVAILABLE)],
                          ready="the orchestrator model is not ready")

    async def check(client):
        resp = await client.post("/v1/completions", json={"model": "demo", "prompt": "a"})
        assert resp.status == 503
        assert "the orchestrator model is not ready" in (await resp.json())["error"]["message"]
    run(relay, check, demo_engine)


def test_a_timeout_is_504_even_once_the_server_turned_not_ready(demo_engine):
    relay = ScriptedRelay([OrchestratorError("context server 127.0.0.1:1: ...",
                                             ErrorCode.TIMEOUT)],
                          ready="tritonserver is not ready")

    async def check(client):
        resp = await client.post("/v1/completions", json={"model": "demo", "prompt": "a"})
        body = await resp.json()
        assert resp.status == 504 and body["error"]["code"] == "server_error"
        assert "timed out" in body["error"]["message"]
    run(relay, check, demo_engine)


def test_a_stream_failing_part_way_ends_with_an_error_not_done(demo_engine):
    relay = ScriptedRelay([WORDS[0], OrchestratorError("generation server x was lost (gone)",
                                                         ErrorCode.UNAVAILABLE)])

    async def check(client):
        resp = await client.post("/v1/completions", json={"model": "demo", "prompt": "a",
                                                          "stream": True})
        text = await resp.text()
        assert resp.status == 200 and '"Hello"' in text
        assert '"error"' in text and "[DONE]" not in text and "finish_reason\": \"" not in text
    run(relay, check, demo_engine)


def test_health_says_why_not_ready(demo_engine):
    async def check(client):
        resp = await client.get("/healthz")
        assert resp.status == 503 and (await resp.json())["reason"] == "orchestrator loading"
        assert (await client.get("/health")).status == 503
        assert (await (await client.get("/version")).json())["model"] == "demo"
    run(ScriptedRelay(WORDS, ready="orchestrator loading"), check, demo_engine)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_ends_the_relay_stream(demo_engine, stream):
    relay = ScriptedRelay(WORDS * 50, pause=0.05)

    async def check(client):
        request = client.post("/v1/completions", json={"model": "demo", "prompt": "a",
                                                       "stream": stream})
        task = asyncio.ensure_future(request)
        if stream:
            resp = await task
            await resp.content.readline()
            resp.close()
        else:
            await asyncio.sleep(0.3)
            task.cancel()
        await relay.until_left()
    run(relay, check, demo_engine)


LOGPROB_WORDS = [Delta("Hello", 3, 1, (10,), (-0.5,)), Delta(" world", 3, 3, (11, 12), (-1.0, -2.0))]


def test_logprobs_of_completions_and_chat_name_each_token(demo_engine):
    """The orchestrator's output_ids/output_log_probs as OpenAI's objects, whole or streamed."""
    preparer = RequestEncoder(demo_engine, "demo")
    names = [preparer.token_text(i) for i in (10, 11, 12)]

    async def check(client):
        resp = await client.post("/v1/completions", json={
            "model": "demo", "prompt": "ab", "max_tokens": 3, "logprobs": 2, "echo": False})
        logprobs = (await resp.json())["choices"][0]["logprobs"]
        assert logprobs["tokens"] == names
        assert logprobs["token_logprobs"] == [-0.5, -1.0, -2.0]
        assert logprobs["top_logprobs"] == [{n: lp} for n, lp in zip(names, [-0.5, -1.0, -2.0])]
        assert logprobs["text_offset"] == [0, len(names[0]), len(names[0]) + len(names[1])]
        resp = await client.post("/v1/chat/completions", json={
            "model": "demo", "messages": [{"role": "user", "content": "a"}], "max_tokens": 3,
            "logprobs": True, "top_logprobs": 1, "stream": True})
        chunks = [json.loads(l[len("data: "):]) for l in (await resp.text()).split("\n\n")
                  if l.startswith("data: {")]
        content = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                   for e in c["choices"][0]["logprobs"]["content"]]
        assert [e["token"] for e in content] == names
        assert [e["logprob"] for e in content] == [-0.5, -1.0, -2.0]
        assert content[0]["bytes"] == list(names[0].encode())
        assert content[0]["top_logprobs"] == [{"token": names[0], "logprob": -0.5,
                                               "bytes": list(names[0].encode())}]
    run(ScriptedRelay(LOGPROB_WORDS), check, demo_engine)


def test_echo_with_logprobs_lists_the_prompt_tokens_then_the_generated(demo_engine):
    """lm-eval's loglikelihood request: the prompt's tokens (null first, each with its
    alternatives and its own log-prob), then the generated token, offsets running on."""
    import numpy as np

    from triton_disagg.engine.prompt_logprobs import PromptLogprobs

    preparer = RequestEncoder(demo_engine, "demo")
    prompt = [5, 6, 7]
    given = PromptLogprobs(np.array([-1.5, -0.25], np.float32),
                           np.array([[9, 6], [7, 3]], np.int32),       # [n-1, k]: 6 not the best
                           np.array([[-0.5, -1.5], [-0.25, -2.0]], np.float32))
    first = Delta("x", 3, 1, (10,), (-0.75,), finish_reason="length", prompt_logprobs=given)
    text = [preparer.token_text(i) for i in prompt + [10]]
    alt = preparer.token_text(9)

    async def check(client):
        resp = await client.post("/v1/completions", json={
            "model": "demo", "prompt": [prompt], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True})
        logprobs = (await resp.json())["choices"][0]["logprobs"]
        assert logprobs["tokens"] == text
        assert logprobs["token_logprobs"] == [None, -1.5, -0.25, -0.75]
        assert logprobs["top_logprobs"] == [None, {alt: -0.5, text[1]: -1.5}, {text[2]: -0.25},
                                            {text[3]: -0.75}]
        assert logprobs["text_offset"] == [sum(len(t) for t in text[:i]) for i in range(4)]
        # lm-eval's parse_logprobs: greedy where the prompt's token is the most likely
        greedy = [tok == max(top.values()) for tok, top in
                  zip(logprobs["token_logprobs"][1:-1], logprobs["top_logprobs"][1:-1])]
        assert greedy == [False, True]
    run(ScriptedRelay([first]), check, demo_engine)


def test_echo_starts_the_text_with_the_prompt(demo_engine):
    async def check(client):
        body = {"model": "demo", "prompt": "Say: ", "max_tokens": 3, "echo": True}
        whole = await (await client.post("/v1/completions", json=body)).json()
        assert whole["choices"][0]["text"] == "Say: Hello 世界 🎉"
        resp = await client.post("/v1/completions", json={**body, "stream": True})
        chunks = [json.loads(l[len("data: "):]) for l in (await resp.text()).split("\n\n")
                  if l.startswith("data: {")]
        assert chunks[0]["choices"][0]["text"] == "Say: "
        assert "".join(c["choices"][0]["text"] for c in chunks) == "Say: Hello 世界 🎉"
    run(ScriptedRelay(WORDS), check, demo_engine)


def test_models_retrieve_and_root(demo_engine):
    async def check(client):
        listed = (await (await client.get("/v1/models")).json())["data"]
        assert [(m["id"], m["root"]) for m in listed] == [("demo", "demo")]
        one = await client.get("/v1/models/demo")
        assert one.status == 200 and await one.json() == listed[0]
        other = await client.get("/v1/models/org/other")
        body = await other.json()
        assert other.status == 404 and body["error"]["code"] == "model_not_found"
        assert body["error"]["param"] == "model"
    run(ScriptedRelay(WORDS), check, demo_engine)


ACCEPTED = [("completions", {"model": "demo", "prompt": [[5, 6]], "logprobs": 2, "top_k": -1,
                             "repetition_penalty": 1.0, "n": 1, "stop": ["x"]}),
            ("chat", {"model": "demo", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "a"}]}], "logprobs": True, "top_logprobs": 3}),
            ("inference", {"prompt": "Hello, world!", "model": "demo", "top_k": 4})]
REFUSED = [("completions", {"model": "demo", "prompt": [5, 2**20]}),
           ("completions", {"model": "demo", "prompt": "a", "min_p": 0.5}),
           ("completions", {"model": "demo", "prompt": "a", "frobnicate": 1}),
           ("chat", {"model": "demo", "messages": []}),
           ("inference", {"model": "demo"})]


def test_the_openapi_document_covers_every_route_and_checks_as_parse_does(demo_engine):
    """GET /openapi.json: every route the app serves is in it, and its body schemas accept
    what parse accepts and refuse what parse refuses (samples)."""
    import jsonschema

    from triton_disagg.front.openai_api import parse

    preparer = RequestEncoder(demo_engine, "demo")

    async def check(client):
        resp = await client.get("/openapi.json")
        doc = await resp.json()
        assert resp.status == 200 and doc["openapi"] == "3.1.0"
        routes = {(r.method.lower(), r.resource.canonical) for r in client.app.router.routes()
                  if r.method in ("GET", "POST")}
        documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
        assert routes == documented
        schemas = doc["components"]["schemas"]
        for endpoint, body in ACCEPTED:
            parse(endpoint, body, preparer.limits)
            jsonschema.validate(body, schemas[f"{endpoint.capitalize()}Request"])
        for endpoint, body in REFUSED:
            with pytest.raises(ApiError):
                parse(endpoint, body, preparer.limits)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(body, schemas[f"{endpoint.capitalize()}Request"])
    run(ScriptedRelay(WORDS), check, demo_engine)


def test_several_prompts_and_n_answer_as_indexed_choices(demo_engine):
    relay = ScriptedRelay(WORDS)

    async def check(client):
        resp = await client.post("/v1/completions", json={
            "model": "demo", "prompt": [[5, 6], "b"], "n": 2, "max_tokens": 3},
            headers={"X-Request-Id": "many"})
        body = await resp.json()
        assert resp.status == 200, body
        assert [(c["index"], c["text"]) for c in body["choices"]] == \
            [(i, "Hello 世界 🎉") for i in range(4)]
        # each prompt counted once (the relay says 3 prompt tokens), every choice's tokens
        assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 12,
                                 "total_tokens": 18, "prompt_tokens_details": {"cached_tokens": 0}}
        assert sorted(relay.request_ids) == [f"many-{i}" for i in range(4)]
    run(relay, check, demo_engine)


def test_a_failing_choice_fails_the_request_and_stops_the_others(demo_engine):
    relay = ScriptedRelay([Delta("a", 1, 1), OrchestratorError("internal error: x",
                                                               ErrorCode.INTERNAL)],
                          pause=0.05)

    async def check(client):
        resp = await client.post("/v1/completions", json={
            "model": "demo", "prompt": "a", "n": 3, "max_tokens": 3})
        assert resp.status == 500 and "internal error" in (await resp.json())["error"]["message"]
        assert len(relay.left_early) == 3        # every stream ended, none left open
    run(relay, check, demo_engine)


def test_vllm_bench_serves_completions_body_is_served(demo_engine):
    """The body `vllm bench serve --backend openai` sends (vllm/benchmarks/lib/
    endpoint_request_func.py): repetition_penalty 1.0 and logprobs null on every request."""
    async def check(client):
        resp = await client.post("/v1/completions", json={
            "model": "demo", "prompt": "a b c", "temperature": 0.0, "repetition_penalty": 1.0,
            "max_tokens": 3, "logprobs": None, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}})
        text = await resp.text()
        assert resp.status == 200 and text.endswith("data: [DONE]\n\n"), text
    run(ScriptedRelay(WORDS), check, demo_engine)

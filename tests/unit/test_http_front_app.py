"""The HTTP front's aiohttp app in this process, its relay replaced by a scripted one (the
real relay against a real tritonserver: tests/server/test_http_front.py): error JSON for
every failure, the request id, health, a stream that fails part-way, and a client that
leaves cancelling its relay stream. OpenAI's and vLLM's fields through the app:
test_http_front_fields.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from scripted_relay import WORDS, ScriptedRelay, response, run
from triton_disagg.errors import ErrorCode
from triton_disagg.front.http_front import MAX_BODY_BYTES
from triton_disagg.front.orchestrator_call import OrchestratorError


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
    relay = ScriptedRelay([response("Hello", 3, tokens, finish_reason=given)])

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

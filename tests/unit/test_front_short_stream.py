"""A stream the orchestrator ends without its final answer (no finish reason: Triton's bare
final flag, which the orchestrator sends when it was told the request was cancelled) is a
server error at the front, never a normal ``"stop"`` with ``[DONE]`` (issue 27 re-review
F6): the client cannot tell a short text from a whole one otherwise."""

from __future__ import annotations

from scripted_relay import ScriptedRelay, response, run


def test_a_stream_without_its_final_answer_is_an_error(demo_engine):
    relay = ScriptedRelay([response("Hello", 3, 1)])           # no finish_reason: cut short

    async def check(client):
        body = {"model": "demo", "prompt": "a", "max_tokens": 3}
        whole = await client.post("/v1/completions", json=body)
        assert whole.status == 500 and "stop" not in await whole.text()
        streamed = await client.post("/v1/completions", json={**body, "stream": True})
        text = await streamed.text()
        assert '"error"' in text and "[DONE]" not in text and '"finish_reason": "stop"' \
            not in text, text
    run(relay, check, demo_engine)


def test_a_stop_sequence_still_ends_a_stream_the_front_cut(demo_engine):
    relay = ScriptedRelay([response("Hello world", 3, 2), response(" more", 3, 3)])

    async def check(client):
        resp = await client.post("/v1/completions", json={
            "model": "demo", "prompt": "a", "max_tokens": 3, "stop": [" world"]})
        body = await resp.json()
        assert resp.status == 200, body
        assert body["choices"][0]["text"] == "Hello" and \
            body["choices"][0]["finish_reason"] == "stop"
    run(relay, check, demo_engine)

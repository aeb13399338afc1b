"""The HTTP front keeps its event loop for I/O: the prompt's log-probs of an ``echo`` with
``logprobs`` (a tokenizer decode per prompt token and per alternative: seconds for a long
prompt and 8 choices) are turned into OpenAI's objects off the loop (issue 27 re-review
F2), so /healthz and the other streams go on meanwhile; the OpenAPI document is made once."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from scripted_relay import ScriptedRelay, response
from triton_disagg.engine.prompt_logprobs import PromptLogprobs
from triton_disagg.front.http_front import make_app
from triton_disagg.front.orchestrator_call import RequestEncoder

PROMPT = [5, 6, 7, 8]


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_are_made_off_the_loop(demo_engine, stream):
    rows = len(PROMPT) - 1
    prompt = PromptLogprobs(np.full(rows, -1.0, np.float32), np.full((rows, 1), 9, np.int32),
                            np.full((rows, 1), -0.5, np.float32))
    relay = ScriptedRelay([response("x", 4, 1, token_ids=(3,), log_probs=(-0.1,),
                                 prompt_logprobs=prompt),
                           response("y", 4, 2, token_ids=(4,), log_probs=(-0.2,),
                                 finish_reason="length")])
    encoder = RequestEncoder(demo_engine, "demo")
    decoded_on: list[threading.Thread] = []
    token_text = encoder.token_text

    def recorded(token_id: int) -> str:
        decoded_on.append(threading.current_thread())
        return token_text(token_id)
    encoder.token_text = recorded

    async def main():
        app = make_app(encoder, relay)
        async with TestClient(TestServer(app, handler_cancellation=True)) as client:
            resp = await client.post("/v1/completions", json={
                "model": "demo", "prompt": PROMPT, "max_tokens": 2, "echo": True,
                "logprobs": 1, "stream": stream})
            assert resp.status == 200, await resp.text()
            await resp.read()
            return threading.current_thread()

    loop_thread = asyncio.run(main())
    prompt_decodes = len(PROMPT) + rows              # each token's text and its alternative's
    assert len(decoded_on) >= prompt_decodes
    assert loop_thread not in decoded_on[:prompt_decodes], "prompt log-probs made on the loop"
    made_on = {thread.name.rsplit("_", 1)[0] for thread in decoded_on[:prompt_decodes]}
    assert made_on == {"prompt-logprobs"}, made_on     # its bounded pool, not the shared one


def test_the_openapi_document_is_made_once(demo_engine, monkeypatch):
    """``GET /openapi.json`` is public and ungated: its schema (5 ms of pydantic on the loop)
    is made once, not per request (issue 27 re-review: a GET flood cost 50x a /v1/models)."""
    from triton_disagg.front import http_front

    made = []
    monkeypatch.setattr(http_front, "document", lambda limits, *posts: made.append(limits) or {"a": 1})
    relay = ScriptedRelay([])

    async def main():
        app = make_app(RequestEncoder(demo_engine, "demo"), relay)
        async with TestClient(TestServer(app)) as client:
            for _ in range(3):
                resp = await client.get("/openapi.json")
                assert resp.status == 200 and await resp.json() == {"a": 1}
    asyncio.run(main())
    assert len(made) == 1

"""The HTTP front's bounds on a body before it is read or parsed (rev27k M3): ``json.loads``
holds the GIL for as long as it parses (a 10 MiB body of small ints stalled the front's
event loop, which serves every stream and door, ~0.4 s however many threads parse), so a
body longer than the served engine can use is a 413 from its ``Content-Length``, unread, and
one of more JSON values than any request to it needs is a 400 counted from its bytes, never
parsed (:class:`~triton_disagg.front.openai_api.BodyBounds`). The largest legitimate bodies
still pass: ``MAX_CHOICES`` prompts of ``max_seq_len`` token ids (lm-eval's, vllm bench's),
of ``max_prompt_chars`` characters each escaped, a chat of ``max_seq_len`` messages."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from scripted_relay import BODY, WORDS, ScriptedRelay, run
from triton_disagg.front import openai_api
from triton_disagg.front.http_front import make_app
from triton_disagg.front.openai_api import BODY_BOUNDS, MAX_BODY_BYTES, BodyBounds, json_size
from triton_disagg.front.openai_models import MAX_CHOICES, EngineLimits
from triton_disagg.front.orchestrator_call import RequestEncoder


def _largest_bodies(limits: EngineLimits, max_prompt_chars: int) -> list[bytes]:
    """The largest bodies of each kind the engine takes (each would pass parse's checks)."""
    last = limits.vocab_size - 1
    ids = {"model": "demo", "prompt": [[last] * limits.max_seq_len] * MAX_CHOICES}
    text = {"model": "demo", "prompt": ["\U0001F600" * max_prompt_chars] * MAX_CHOICES}
    chat = {"model": "demo", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}], "name": "x"}] * limits.max_seq_len}
    return [json.dumps(b).encode() for b in (ids, text, chat)]    # ensure_ascii: \ud83d\ude00


@pytest.mark.parametrize("limits, chars", [(EngineLimits(256, 1000), 256 * 64),
                                           (EngineLimits(4096, 128_256), 4096 * 64),
                                           (EngineLimits(32_768, 152_064), 32_768 * 64)])
def test_the_largest_legitimate_bodies_are_within_the_bounds(limits, chars):
    bounds = BodyBounds.of(limits, chars)
    assert bounds.max_bytes <= MAX_BODY_BYTES
    for raw in _largest_bodies(limits, chars):
        assert len(raw) <= bounds.max_bytes or bounds.max_bytes == MAX_BODY_BYTES
        bounds.screen(raw)                                   # no ApiError
        strings, values = json_size(raw, 2**40)
        assert values <= bounds.max_values and strings <= 2 * bounds.max_values


def test_a_body_longer_than_the_engine_can_use_is_a_413_unread(demo_engine):
    """The demo engine's bound is MAX_BODY_BYTES (its max_seq_len 2048 allows 8 prompts of
    131072 characters); a smaller engine's is smaller, and the front holds its own."""
    preparer = RequestEncoder(demo_engine, "demo")
    assert BodyBounds.of(EngineLimits(128, 1000), 128 * 64).max_bytes == \
        8 * 128 * 64 * 12 + 2**20
    bounds = BodyBounds(max_bytes=4096, max_values=1000)

    async def main():
        app = make_app(preparer, ScriptedRelay(WORDS))
        assert app[BODY_BOUNDS] == BodyBounds.of(preparer.limits, preparer.max_prompt_chars)
        app[BODY_BOUNDS] = bounds
        async with TestClient(TestServer(app)) as client:
            for path in ("/v1/completions", "/tokenize"):
                resp = await client.post(path, data=b" " * (bounds.max_bytes + 1),
                                         headers={"Content-Type": "application/json"})
                error = (await resp.json())["error"]
                assert resp.status == 413 and "4096 bytes" in error["message"], error
            assert (await client.post("/v1/completions", json=BODY)).status == 200
    asyncio.run(main())


def test_a_body_of_more_values_than_any_request_needs_is_refused_unparsed(demo_engine,
                                                                           monkeypatch):
    preparer = RequestEncoder(demo_engine, "demo")
    bounds = BodyBounds.of(preparer.limits, preparer.max_prompt_chars)
    parsed = []
    decode = openai_api.decode
    monkeypatch.setattr(openai_api, "decode", lambda raw: parsed.append(len(raw)) or decode(raw))
    many = b'{"model": "demo", "prompt": [' + b",".join([b"1"] * (bounds.max_values + 1)) \
        + b"]}"
    strings = b"[" + b",".join([b'""'] * (2 * bounds.max_values + 1)) + b"]"
    assert len(many) <= bounds.max_bytes and len(strings) <= bounds.max_bytes

    async def check(client):
        for raw, words in ((many, "values"), (strings, "strings")):
            for path in ("/v1/completions", "/detokenize"):
                resp = await client.post(path, data=raw)
                error = (await resp.json())["error"]["message"]
                assert resp.status == 400 and words in error and \
                    str(bounds.max_values) in error, error
        assert parsed == []
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    run(ScriptedRelay(WORDS), check, demo_engine)

"""Hostile request bodies at the HTTP front (openai_api.py: read_json and parse, the
pydantic models' bounds): malformed or pathological JSON is a 400 naming the problem, every
field is bounded by the served engine, a huge chat prompt is refused before it is tokenized,
and a compressed body is a 415, unread."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import ClientSession

from scripted_relay import BODY, WORDS, ScriptedRelay, run, served
from triton_disagg.config.front_section import FrontConfig
from triton_disagg.front.openai_api import ApiError, EngineLimits, parse
from triton_disagg.front.orchestrator_call import RequestEncoder


# ---- hostile JSON and bounded fields ------------------------------------------------------

@pytest.mark.parametrize("raw_body, headers, words", [
    (b"[" * 100_000 + b"]" * 100_000, {}, "nested too deeply"),
    (b'{"model": "demo", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", {}, "digits"),
    (b'{"model": "demo", "prompt": "a", "max_tokens": 1e999}', {}, "'max_tokens'"),
    (b'{"model": "demo", "prompt": "a", "max_tokens": 99999999999999999999}', {},
     "'max_tokens'"),
    (b'{"model": "demo", "prompt": "a", "top_p": ' + b"[" * 900 + b"]" * 900 + b"}", {},
     "'top_p'"),
    # a lone surrogate (found by a fuzzer: 500 when the prompt was encoded), in a value or a key
    (b'{"model": "demo", "prompt": "a\\ud800b", "max_tokens": 2}', {}, "'\\ud800'"),
    (b'{"model": "demo", "prompt": "a", "stop": ["\\udfff"]}', {}, "lone UTF-16 surrogate"),
    (b'{"model": "demo", "prompt": "a", "\\udbff\\ud800": 1}', {}, "'\\udbff'"),
])
def test_hostile_json_is_a_400_naming_the_problem(demo_engine, raw_body, headers, words):
    async def check(client):
        for path in ("/v1/completions", "/v1/inference"):
            resp = await client.post(path, data=raw_body,       # a broken body ends its
                                     headers={**headers, "Connection": "close"})  # connection
            body = await resp.json()
            assert resp.status == 400 and words in body["error"]["message"], body
            assert len(body["error"]["message"]) < 300
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    run(ScriptedRelay(WORDS), check, demo_engine)


LIMITS = EngineLimits(max_seq_len=256, vocab_size=1000)
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("endpoint, body, names", [
    ("completions", {**BODY, "max_tokens": 256}, "'max_tokens': 256 must be between 1 and 255"),
    ("chat", {**CHAT, "max_completion_tokens": 2**40}, "'max_completion_tokens'"),
    ("inference", {"prompt": "a", "top_k": 1001}, "'top_k': 1001 must be between -1 and 1000"),
    ("completions", {**BODY, "stop": ["x" * 257]}, "'stop[0]': 257 characters; at most 256"),
    ("chat", {**CHAT, "messages": CHAT["messages"] * 257}, "'messages': 257 items; at most 256"),
    # counted before a single id is looked at: the count is named, not the first bad id
    ("completions", {**BODY, "prompt": [-1] * 257}, "'prompt': 257 items; at most 256"),
    ("completions", {**BODY, "prompt": [[1]] * 9}, "'prompt': 9 items; at most 8"),
    ("inference", {"prompt": [1]}, "'prompt': expected a string"),   # found by schemathesis
])
def test_fields_are_bounded_by_the_engine(endpoint, body, names):
    with pytest.raises(ApiError) as err:
        parse(endpoint, body, LIMITS)
    assert err.value.status == 400 and names in str(err.value)


def test_a_huge_chat_prompt_is_refused_before_it_is_tokenized(demo_engine, monkeypatch):
    preparer = RequestEncoder(demo_engine, "demo")
    encoded = []
    monkeypatch.setattr(preparer.tokenizer, "encode", lambda text: encoded.append(len(text)))
    for content in ("a" * (preparer.max_prompt_chars + 1), "a" * preparer.max_prompt_chars):
        gen = parse("chat", {**CHAT, "messages": [{"role": "user", "content": content}]},
                    preparer.limits)
        with pytest.raises(ApiError) as err:
            preparer.inputs(gen)
        assert err.value.status == 400 and "max_seq_len" in str(err.value)
    assert encoded == []

def test_a_compressed_body_is_refused_unread(demo_engine):
    """A ``Content-Encoding`` body is a 415 before it is read: the front takes JSON as sent,
    and aiohttp would inflate a gzip bomb on the event loop (issue 27 re-review: 2 MB of
    gzip, 2 GiB inflated, took 0.6 s of loop and ~100 MiB each before its 413)."""
    import zlib

    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)            # gzip framing
    zeros = b"\0" * 2**24
    bomb = b"".join(deflate.compress(zeros) for _ in range(128)) + deflate.flush()

    async def main():
        async with served(demo_engine, ScriptedRelay(WORDS), FrontConfig()) as port:
            async with ClientSession(auto_decompress=False) as session:
                for body in (bomb, b"not gzip"):
                    began = time.monotonic()
                    async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                            data=body, headers={"Content-Encoding": "gzip"}
                                            ) as resp:
                        error = (await resp.json())["error"]["message"]
                    assert resp.status == 415 and "Content-Encoding" in error, error
                    assert time.monotonic() - began < 2.0
    asyncio.run(main())

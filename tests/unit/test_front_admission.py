"""The HTTP front's admission control (triton_disagg/front/http_gates.py, openai_api.py's
read_json; the ``front`` config section) in this process, its relay scripted
(tests/support/scripted_relay.py): the request cap answers 429 with Retry-After at once and
counts back down, the connection cap 503, slow clients are cut off (headers, body, a
reader that never reads), hostile JSON is a 400, a foreign Origin or Host a 403, and a
server fault's body names no internal address."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestClient, TestServer

from scripted_relay import WORDS, ScriptedRelay
from triton_disagg.config.disagg import parse_config
from triton_disagg.config.front_section import (FrontConfig, add_front_flags, front_flags,
                                                front_from_flags, parse_front)
from triton_disagg.errors import ErrorCode, UserError
from triton_disagg.front.http_front import _serve, make_app
from triton_disagg.front.openai_api import ApiError, EngineLimits, parse
from triton_disagg.front.prepare import RequestEncoder
from triton_disagg.front.relay import Delta, OrchestratorError
from triton_disagg.launch.deploy import free_ports

BODY = {"model": "demo", "prompt": "a", "max_tokens": 3}


def run_app(relay, check, demo_engine, front=FrontConfig(), bound_host="127.0.0.1"):
    async def main():
        app = make_app(RequestEncoder(demo_engine, "demo"), relay, front, bound_host)
        async with TestClient(TestServer(app, handler_cancellation=True)) as client:
            await check(client)
    asyncio.run(main())


@contextlib.asynccontextmanager
async def served(demo_engine, relay, front: FrontConfig):
    """The front's app served as its process serves it (its runner, caps and timeouts) on a
    free loopback port; yields the port."""
    app = make_app(RequestEncoder(demo_engine, "demo"), relay, front)
    (port,) = free_ports(1)
    task = asyncio.ensure_future(_serve(app, "127.0.0.1", port, front))
    for _ in range(200):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
            break
        await asyncio.sleep(0.02)
    try:
        yield port
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def raw(port: int, data: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if data:
        writer.write(data)
        await writer.drain()
    return reader, writer


# ---- the request cap ----------------------------------------------------------------------

def test_requests_past_the_cap_get_429_with_retry_after_at_once(demo_engine):
    relay = ScriptedRelay(WORDS, pause=0.3)            # ~1 s per admitted request

    async def check(client):
        began = time.monotonic()

        async def one():
            resp = await client.post("/v1/completions", json=BODY)
            return resp.status, resp.headers.get("Retry-After"), await resp.json(), \
                time.monotonic() - began
        answers = await asyncio.gather(*(one() for _ in range(8)))
        ok = [a for a in answers if a[0] == 200]
        refused = [a for a in answers if a[0] == 429]
        assert len(ok) == 2 and len(refused) == 6, [a[0] for a in answers]
        for _, retry_after, body, took in refused:
            assert retry_after == "1" and took < 0.5
            assert "max_concurrent_requests" in body["error"]["message"]
            assert body["error"]["type"] == "rate_limit_error"
        statuses = [(await client.post("/v1/completions", json=BODY)).status for _ in range(3)]
        assert statuses == [200] * 3                    # the count went back down
        metrics = await (await client.get("/metrics")).text()     # the front's own
        for line in ('disagg_front_requests_total{route="/v1/completions",status="200"} 5',
                     'disagg_front_requests_total{route="/v1/completions",status="429"} 6',
                     'disagg_front_refusals_total{cap="max_concurrent_requests"} 6',
                     'disagg_front_refusals_total{cap="max_connections"} 0',
                     "disagg_front_requests_in_flight 1"):     # the /metrics request itself
            assert line in metrics.splitlines(), metrics
    run_app(relay, check, demo_engine, FrontConfig(max_concurrent_requests=2))


def test_tokenizer_routes_count_against_the_cap(demo_engine):
    """``/tokenize`` and ``/detokenize`` read a body and tokenize it: a slot each, like a
    completion (past the cap 429 at once), so a flood of them cannot starve generation."""
    relay = ScriptedRelay(WORDS, pause=0.3)

    async def check(client):
        held = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
        while not relay.request_ids:                    # the completion holds the slot
            await asyncio.sleep(0.01)
        for path, body in (("/tokenize", {"model": "demo", "prompt": "hello"}),
                           ("/detokenize", {"model": "demo", "tokens": [1, 2]})):
            resp = await client.post(path, json=body)
            assert resp.status == 429 and resp.headers.get("Retry-After") == "1", path
        assert (await held).status == 200
        resp = await client.post("/tokenize", json={"model": "demo", "prompt": "hello"})
        assert resp.status == 200 and (await resp.json())["count"] >= 1
    run_app(relay, check, demo_engine, FrontConfig(max_concurrent_requests=1))


def test_a_client_that_leaves_gives_its_slot_back(demo_engine):
    relay = ScriptedRelay(WORDS * 50, pause=0.05)

    async def check(client):
        task = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
        await asyncio.sleep(0.3)
        task.cancel()
        await relay.until_left()
        relay.deltas, relay.pause = WORDS, 0.0
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    run_app(relay, check, demo_engine, FrontConfig(max_concurrent_requests=1))


# ---- the connection cap and slow clients --------------------------------------------------

def test_a_connection_past_the_cap_gets_503_and_a_freed_one_is_served(demo_engine):
    async def main():
        front = FrontConfig(max_connections=2)
        async with served(demo_engine, ScriptedRelay(WORDS), front) as port:
            held = [await raw(port) for _ in range(2)]
            reader, writer = await raw(port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 5)
            assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer
            assert b"max_connections" in answer
            writer.close()
            held[0][1].close()
            await asyncio.sleep(0.2)
            async with ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                        json=BODY) as resp:
                    assert resp.status == 200
                async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    metrics = (await resp.text()).splitlines()
                assert 'disagg_front_refusals_total{cap="max_connections"} 1' in metrics
            held[1][1].close()
    asyncio.run(main())


def test_trickled_headers_are_cut_off_at_the_idle_timeout(demo_engine):
    async def main():
        front = FrontConfig(idle_timeout_seconds=0.5)
        async with served(demo_engine, ScriptedRelay(WORDS), front) as port:
            reader, writer = await raw(port, b"POST /v1/completions HTTP/1.1\r\n")
            began = time.monotonic()
            with contextlib.suppress(ConnectionError):
                for byte in b"Host: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0.1)
                    if reader.at_eof() or writer.is_closing():
                        break
            assert await asyncio.wait_for(reader.read(), 5) == b""     # closed by the server
            assert time.monotonic() - began < 3
    asyncio.run(main())


def test_a_trickled_body_gets_408_at_the_body_timeout(demo_engine):
    async def main():
        front = FrontConfig(body_timeout_seconds=0.5)
        async with served(demo_engine, ScriptedRelay(WORDS), front) as port:
            reader, writer = await raw(port, b"POST /v1/completions HTTP/1.1\r\n"
                                             b"Host: 127.0.0.1\r\nContent-Length: 1000\r\n"
                                             b"Content-Type: application/json\r\n\r\n{")
            began = time.monotonic()
            head = await asyncio.wait_for(reader.readline(), 5)
            assert head.startswith(b"HTTP/1.1 408") and time.monotonic() - began < 3
            writer.close()
    asyncio.run(main())


def test_a_client_that_never_reads_its_stream_is_dropped_and_its_request_ended(demo_engine):
    relay = ScriptedRelay([Delta("x" * 2**16, 1, 1)] * 2000)     # up to 128 MiB of text

    async def main():
        async with served(demo_engine, relay, FrontConfig(write_timeout_seconds=0.5)) as port:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            body = json.dumps({**BODY, "stream": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await relay.until_left()                    # it never read a byte
            sock.close()
    asyncio.run(main())


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
    run_app(ScriptedRelay(WORDS), check, demo_engine)


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


# ---- Origin and Host ----------------------------------------------------------------------

@pytest.mark.parametrize("headers, bound, front, status", [
    ({"Origin": "http://evil.example"}, "127.0.0.1", FrontConfig(), 403),
    ({"Origin": "null"}, "0.0.0.0", FrontConfig(), 403),
    ({"Origin": "https://ui.example"}, "127.0.0.1",
     FrontConfig(allowed_origins=("https://ui.example",)), 200),
    ({"Host": "rebound.example:8080"}, "127.0.0.1", FrontConfig(), 403),
    ({"Host": "localhost:8080"}, "127.0.0.1", FrontConfig(), 200),
    ({"Host": "[::1]:8080"}, "::1", FrontConfig(), 200),
    ({"Host": "llm.internal:8080"}, "0.0.0.0", FrontConfig(), 200),
    ({"Host": "other.internal"}, "0.0.0.0", FrontConfig(allowed_hosts=("llm.internal",)), 403),
    ({"Host": "LLM.internal:80"}, "127.0.0.1", FrontConfig(allowed_hosts=("llm.internal",)), 200),
])
def test_origin_and_host_are_checked(demo_engine, headers, bound, front, status):
    async def check(client):
        for method, path in (("POST", "/v1/completions"), ("GET", "/healthz")):
            resp = await client.request(method, path, json=BODY, headers=headers)
            assert resp.status == status, await resp.text()
            if status == 403:
                assert (await resp.json())["error"]["type"] == "permission_error"
            elif "Origin" in headers:
                assert resp.headers["Access-Control-Allow-Origin"] == headers["Origin"]
    run_app(ScriptedRelay(WORDS), check, demo_engine, front, bound)


# ---- what a fault's body says -------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("error", [
    OrchestratorError("generation server 10.9.8.7:8001 was lost (UNAVAILABLE: refused)",
                      ErrorCode.UNAVAILABLE),
    RuntimeError("boom at /srv/secret/path"),
])
def test_a_fault_body_names_the_request_not_the_internals(demo_engine, error, stream):
    async def check(client):
        resp = await client.post("/v1/completions", json={**BODY, "stream": stream},
                                 headers={"X-Request-Id": "req-42"})
        text = await resp.text()
        assert "req-42" in text and "10.9.8.7" not in text and "/srv" not in text, text
        assert "boom" not in text and "UNAVAILABLE" not in text
    run_app(ScriptedRelay([WORDS[0], error] if stream else [error]), check, demo_engine)


def test_a_request_counts_once_per_choice_against_the_cap(demo_engine):
    """``n`` choices are ``n`` orchestrator calls: past the cap they are refused at once
    (429), not sent to an orchestrator instance that would refuse them one by one."""
    async def check(client):
        resp = await client.post("/v1/completions", json={**BODY, "n": 3})
        assert resp.status == 429 and resp.headers.get("Retry-After") == "1", await resp.text()
        assert "once per choice" in (await resp.json())["error"]["message"]
        resp = await client.post("/v1/completions", json={**BODY, "n": 2})
        assert resp.status == 200, await resp.text()
        assert len((await resp.json())["choices"]) == 2
    run_app(ScriptedRelay(WORDS), check, demo_engine, FrontConfig(max_concurrent_requests=2))


def test_a_busy_or_lost_server_is_a_503_with_retry_after(demo_engine):
    async def check(client):
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status == 503 and resp.headers.get("Retry-After") == "1", await resp.text()
    busy = OrchestratorError("this server is busy with its most requests at once; retry later",
                             ErrorCode.UNAVAILABLE)
    run_app(ScriptedRelay([busy]), check, demo_engine)


# ---- the config section -------------------------------------------------------------------

def test_front_section_parses_and_round_trips_through_flags(tmp_path, demo_engine):
    import argparse

    config = parse_config({"model": {"engine": str(demo_engine)}, "front": {
        "max_concurrent_requests": 8, "body_timeout_seconds": 2.5,
        "allowed_origins": ["https://ui.example"]}})
    assert config.front == FrontConfig(max_concurrent_requests=8, body_timeout_seconds=2.5,
                                       allowed_origins=("https://ui.example",))
    parser = argparse.ArgumentParser()
    add_front_flags(parser)
    assert front_from_flags(parser.parse_args(front_flags(config.front))) == config.front
    assert front_from_flags(parser.parse_args([])) == FrontConfig()
    for bad, words in (({"max_connections": 0}, "front.max_connections"),
                       ({"write_timeout_seconds": -1}, "front.write_timeout_seconds"),
                       ({"allowed_hosts": "x"}, "front.allowed_hosts"),
                       ({"max_requests": 1}, "unknown key 'max_requests'")):
        with pytest.raises(UserError, match=words):
            parse_front(bad)


def test_a_whole_answer_the_client_never_reads_gives_its_connection_back(demo_engine):
    """A non-streamed answer is written within ``write_timeout_seconds`` too: a client that
    never reads it (issue 27 re-review F1) is dropped, and its connection is free again."""
    relay = ScriptedRelay([Delta("x" * 2**20, 1, i + 1) for i in range(8)]
                          + [Delta("", 1, 9, finish_reason="length")])   # 8 MiB of text

    async def main():
        front = FrontConfig(max_connections=1, write_timeout_seconds=0.5)
        async with served(demo_engine, relay, front) as port:
            await asyncio.sleep(0.5)                    # served's probe connection is gone
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            body = json.dumps(BODY).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await asyncio.sleep(3.0)                    # it never read a byte
            assert sock.recv(12, socket.MSG_PEEK) == b"HTTP/1.1 200"   # answered, unread
            reader, writer = await raw(port, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head = await asyncio.wait_for(reader.readline(), 5)
            assert head.startswith(b"HTTP/1.1 200"), head   # not 503: the slot came back
            writer.close()
            sock.close()
    asyncio.run(main())


def test_pipelined_gets_never_read_are_dropped_at_the_write_timeout(demo_engine):
    """Every route's answer is bounded by ``write_timeout_seconds``, not only generation's
    (review item 0): a socket that pipelines ~1 MB of ``GET /openapi.json`` and never reads
    is dropped (counted in /metrics), and its connection slot serves the next client."""
    async def main():
        front = FrontConfig(max_connections=1, write_timeout_seconds=0.5)
        async with served(demo_engine, ScriptedRelay(WORDS), front) as port:
            await asyncio.sleep(0.5)                    # served's probe connection is gone
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.setblocking(False)
            request = b"GET /openapi.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 10
            with contextlib.suppress(BlockingIOError):
                for _ in range(2000):
                    sock.send(request)
            await asyncio.sleep(3.0)                    # it never read a byte
            reader, writer = await raw(port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                              b"Connection: close\r\n\r\n")
            text = (await asyncio.wait_for(reader.read(), 5)).decode()
            assert text.startswith("HTTP/1.1 200"), text    # not 503: the slot came back
            assert "disagg_front_stalled_connections_total 1" in text, text
            writer.close()
            sock.close()
    asyncio.run(main())


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

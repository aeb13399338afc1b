"""The HTTP front's admission control (triton_disagg/front/http_gates.py; the ``front``
config section) in this process, its relay scripted (tests/support/scripted_relay.py): the
request cap answers 429 with Retry-After at once and counts back down, the connection cap
503, a foreign Origin or Host a 403, and a server fault's body names no internal address.
Slow clients: test_front_slow_clients.py; hostile bodies: test_front_hostile_input.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import ClientSession

from scripted_relay import BODY, WORDS, ScriptedRelay, raw, run, served
from triton_disagg.config.disagg import parse_config
from triton_disagg.config.front_section import (FrontConfig, add_front_flags, front_flags,
                                                front_from_flags, parse_front)
from triton_disagg.errors import ErrorCode, UserError
from triton_disagg.front.http_gates import BODY_GRACE_SECONDS
from triton_disagg.front.orchestrator_call import OrchestratorError


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
    run(relay, check, demo_engine, FrontConfig(max_concurrent_requests=2))


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
    run(relay, check, demo_engine, FrontConfig(max_concurrent_requests=1))


def test_a_client_that_leaves_gives_its_slot_back(demo_engine):
    relay = ScriptedRelay(WORDS * 50, pause=0.05)

    async def check(client):
        task = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
        await asyncio.sleep(0.3)
        task.cancel()
        await relay.until_left()
        relay.deltas, relay.pause = WORDS, 0.0
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    run(relay, check, demo_engine, FrontConfig(max_concurrent_requests=1))

def test_requests_still_sending_their_body_give_their_place_to_a_new_one(demo_engine):
    """rev27k M1: max_concurrent_requests connections each trickling one byte of body held
    the cap for the body timeout (30 s), again and again: every other request was 429. At
    the cap a new request takes the place of the oldest one whose body is still arriving
    (cut: closed, nothing answered) once it has been arriving ``BODY_GRACE_SECONDS``; a
    request whose body has arrived keeps its place."""
    async def main():
        front = FrontConfig(max_concurrent_requests=2)
        relay = ScriptedRelay(WORDS, pause=0.5)
        async with served(demo_engine, relay, front) as port:
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                    b"application/json\r\nContent-Length: 100\r\n\r\n{")
            trickles = [await raw(port, head) for _ in range(2)]
            await asyncio.sleep(BODY_GRACE_SECONDS + 0.2)   # arriving long enough to be cut
            async with ClientSession() as session:
                url = f"http://127.0.0.1:{port}/v1/completions"
                posts = [asyncio.create_task(session.post(url, json=BODY)) for _ in range(2)]
                await asyncio.sleep(0.3)        # both admitted, generating (bodies arrived)
                async with session.post(url, json=BODY) as refused:
                    assert refused.status == 429
                for post in posts:
                    async with await post as answer:
                        assert answer.status == 200, await answer.text()
            for reader, writer in trickles:      # both cut, nothing answered
                assert await asyncio.wait_for(reader.read(), 5) == b""
                writer.close()
    asyncio.run(main())


def test_a_body_on_its_way_keeps_its_place_within_the_grace(demo_engine):
    """CI's burst (four times the cap of streamed requests at once) had connections reset:
    a request's headers reached the gate before its body (two reads), and the next request
    at the cap cut it. Arriving for less than ``BODY_GRACE_SECONDS``, a request keeps its
    place: a newcomer gets the 429, and the request, its body sent, its answer."""
    async def main():
        body = json.dumps(BODY).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        async with served(demo_engine, ScriptedRelay(WORDS),
                          FrontConfig(max_concurrent_requests=1)) as port:
            reader, writer = await raw(port, head)
            await asyncio.sleep(0.2)                 # its headers at the gate, no body yet
            async with ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                        json=BODY) as newcomer:
                    assert newcomer.status == 429, await newcomer.text()
            writer.write(body)
            answer = await asyncio.wait_for(reader.read(), 10)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            writer.close()
    asyncio.run(main())


# ---- the connection cap ------------------------------------------------------------------

def test_a_connection_past_the_cap_gets_503_and_a_freed_one_is_served(demo_engine):
    async def main():
        front = FrontConfig(max_connections=2)
        async with served(demo_engine, ScriptedRelay(WORDS), front) as port:
            held = [await raw(port, b"GET /hea") for _ in range(2)]    # requests under way
            await asyncio.sleep(0.1)
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


def test_connections_that_say_nothing_make_room_for_a_new_one(demo_engine):
    """Issue 27 re-review (low): one client opening every connection and sending nothing held
    the cap until the idle timeout, again and again. At the cap a new connection takes the
    place of the oldest silent one, which is closed; a connection under way is kept."""
    async def main():
        front = FrontConfig(max_connections=3)
        async with served(demo_engine, ScriptedRelay(WORDS), front) as port:
            busy = await raw(port, b"GET /hea")
            silent = [await raw(port) for _ in range(2)]
            await asyncio.sleep(0.1)
            newer = [await raw(port, b"GET /hea") for _ in range(2)]   # each past the cap
            for reader, _ in silent:                  # both evicted: closed, nothing sent
                assert await asyncio.wait_for(reader.read(), 5) == b""
            for reader, writer in [busy, *newer]:     # each served, none refused
                writer.write(b"lthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                answer = await asyncio.wait_for(reader.read(), 5)
                assert answer.startswith(b"HTTP/1.1 ") and not answer.startswith(
                    b"HTTP/1.1 503"), answer[:200]
                writer.close()
    asyncio.run(main())


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
    run(ScriptedRelay(WORDS), check, demo_engine, front, bound)

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
    run(ScriptedRelay([WORDS[0], error] if stream else [error]), check, demo_engine)


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
    run(ScriptedRelay(WORDS), check, demo_engine, FrontConfig(max_concurrent_requests=2))


def test_a_busy_or_lost_server_is_a_503_with_retry_after(demo_engine):
    async def check(client):
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status == 503 and resp.headers.get("Retry-After") == "1", await resp.text()
    busy = OrchestratorError("this server is busy with its most requests at once; retry later",
                             ErrorCode.UNAVAILABLE)
    run(ScriptedRelay([busy]), check, demo_engine)

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

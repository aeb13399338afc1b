"""The HTTP door's request cap and its connections to tritonserver (rev27k M1, L4): a
request whose body has been arriving ``BODY_GRACE_SECONDS`` gives its place under
``max_calls`` to a new request (clients that trickle their bodies cannot keep others out for
longer; a body still on its way within it: test_front_admission.py), one whose body has arrived
keeps it (429 past the cap); the door's pool of connections to tritonserver has no limit
of its own (aiohttp's default, 100, made requests past it, probes included, wait without
end). The inner tritonserver is an in-process aiohttp stand-in."""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web
from local_sites import serve_locally

from triton_disagg.front.http_door import CALLS, make_http_door
from triton_disagg.front.http_gates import BODY_GRACE_SECONDS

MAX_BYTES = 2**20
INFER = "/v2/models/ensemble/infer"


@contextlib.asynccontextmanager
async def _door(max_calls: int, release: asyncio.Event):
    """(the door's URL, its app): its stand-in holds each ``generate_stream`` until
    ``release`` is set and answers everything else at once."""
    async def inner(request: web.Request) -> web.Response:
        await request.read()
        if request.path.endswith("generate_stream"):
            await release.wait()
        return web.Response(body=b"ok")

    inner_app = web.Application()
    inner_app.router.add_route("*", "/{path:.*}", inner)
    inner_runner, inner_port = await serve_locally(inner_app)
    app = make_http_door(f"127.0.0.1:{inner_port}", MAX_BYTES, max_calls, 30.0)
    runner, port = await serve_locally(app)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        release.set()
        await runner.cleanup()
        await inner_runner.cleanup()


async def _trickler(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A request whose headers promise 100 bytes of body, of which one is sent."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {INFER} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                 f"\r\nContent-Length: 100\r\n\r\n{{".encode())
    await writer.drain()
    return reader, writer


def test_bodies_still_arriving_give_their_place_to_a_new_request():
    """rev27k M1: max_calls connections each trickling one byte of body held the cap for
    the body timeout (30 s), again and again: every other request was 429."""
    async def main():
        async with _door(4, asyncio.Event()) as (url, app):
            trickles = [await _trickler(url) for _ in range(4)]
            deadline = time.monotonic() + 5
            while app[CALLS].in_flight < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert app[CALLS].in_flight == 4 and len(app[CALLS].arriving) == 4
            await asyncio.sleep(BODY_GRACE_SECONDS)      # arriving long enough to be cut
            async with ClientSession() as session:
                for _ in range(2):
                    began = time.monotonic()
                    async with session.post(f"{url}{INFER}", data=b"{}") as victim:
                        assert victim.status == 200, await victim.text()
                    assert time.monotonic() - began < 2
            # the first victim took the oldest's place (cut: closed, nothing answered), the
            # second the first victim's, freed when it was answered
            assert await asyncio.wait_for(trickles[0][0].read(), 5) == b""
            assert app[CALLS].in_flight == 3 and len(app[CALLS].arriving) == 3
            for _, writer in trickles:
                writer.close()
            deadline = time.monotonic() + 5
            while app[CALLS].in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert app[CALLS].in_flight == 0 and not app[CALLS].arriving
    asyncio.run(main())


def test_requests_whose_body_arrived_keep_their_place_past_the_cap_is_429():
    async def main():
        release = asyncio.Event()
        async with _door(2, release) as (url, app):
            async with ClientSession() as session:
                held = [asyncio.create_task(session.post(
                    f"{url}/v2/models/ensemble/generate_stream", data=b"{}")) for _ in range(2)]
                deadline = time.monotonic() + 5
                while (app[CALLS].in_flight < 2 or app[CALLS].arriving) \
                        and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                async with session.post(f"{url}{INFER}", data=b"{}") as refused:
                    assert refused.status == 429 and refused.headers["Retry-After"] == "1"
                async with session.get(f"{url}/v2/health/ready") as probe:   # never capped
                    assert probe.status == 200
                release.set()
                for post in held:
                    async with await post as answer:
                        assert answer.status == 200
    asyncio.run(main())


def test_past_a_hundred_calls_to_tritonserver_nothing_waits_for_a_pooled_connection():
    """rev27k L4: with max_calls 200, 100 long requests took every connection of aiohttp's
    default pool and a health probe had no answer in 10 s."""
    async def main():
        release = asyncio.Event()
        async with _door(200, release) as (url, app):
            async with ClientSession(connector=TCPConnector(limit=0)) as session:
                async def long() -> int:
                    async with session.post(f"{url}/v2/models/ensemble/generate_stream",
                                            data=b"{}") as answer:
                        await answer.read()
                        return answer.status
                longs = [asyncio.create_task(long()) for _ in range(110)]
                deadline = time.monotonic() + 20
                while app[CALLS].in_flight < 110 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                async with session.get(f"{url}/v2/health/ready",
                                       timeout=ClientTimeout(total=5)) as probe:
                    assert probe.status == 200
                async with session.post(f"{url}{INFER}", data=b"{}",
                                        timeout=ClientTimeout(total=5)) as other:
                    assert other.status == 200
                release.set()
                assert await asyncio.gather(*longs) == [200] * 110
    asyncio.run(main())

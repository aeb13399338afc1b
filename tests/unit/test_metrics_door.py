"""The metrics door (:mod:`triton_disagg.front.metrics_door`, issue 27 rev27e), in process:
a bodiless ``GET /metrics`` is tritonserver's answer; a POST (what killed Triton 2.51's
metrics server), a body or another path never reaches the inner server; an inner server
that is down is 502. The inner metrics server is an in-process aiohttp stand-in that
counts what reaches it (tests/server/test_served_http_doors.py has the real one)."""

from __future__ import annotations

import asyncio

from aiohttp import ClientSession, web
from local_sites import serve_locally

from triton_disagg.front.metrics_door import make_metrics_door

TEXT = "# TYPE nv_inference_count counter\nnv_inference_count 3\n"


def _inner(seen: list[tuple[str, str, int]]) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append((request.method, request.path_qs, len(body)))
        return web.Response(text=TEXT, content_type="text/plain")

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", metrics)
    return app


def test_a_bodiless_get_is_forwarded_and_nothing_else_reaches_the_inner_server():
    async def main():
        seen: list[tuple[str, str, int]] = []
        inner, inner_port = await serve_locally(_inner(seen))
        door, port = await serve_locally(make_metrics_door(inner_port))
        url = f"http://127.0.0.1:{port}"
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        try:
            async with ClientSession() as session:
                async with session.get(f"{url}/metrics?x=1", headers={"X-A": "b"}) as scraped:
                    assert scraped.status == 200 and await scraped.text() == TEXT
                    assert scraped.headers["Content-Type"].startswith("text/plain")
                async with session.head(f"{url}/metrics") as head:
                    assert head.status == 200
                async with session.post(f"{url}/metrics", data=b"a" * 2**20,
                                        headers=form) as posted:
                    assert posted.status == 405
                async with session.get(f"{url}/metrics", data=b"a" * 1024) as bodied:
                    assert bodied.status == 400 and "no body" in await bodied.text()
                async with session.get(f"{url}/v2/health/ready") as other:
                    assert other.status == 404
            assert seen == [("GET", "/metrics", 0), ("GET", "/metrics", 0)]
            await inner.cleanup()
            async with ClientSession() as session:
                async with session.get(f"{url}/metrics") as down:
                    assert down.status in (502, 503)      # refused, or no owner listening
        finally:
            await door.cleanup()
            await inner.cleanup()
    asyncio.run(main())


def test_a_flood_of_scrapes_shares_one_scrape_at_a_time():
    """rev27i F5: 300 connections looping on ``/metrics`` queued behind 4 scrapes at once and
    4 of 5 one-second liveness probes timed out. A scrape that comes while one runs gets
    that one's answer: tritonserver is scraped once at a time and nobody queues."""
    async def main():
        running, most, scraped = [0], [0], [0]

        async def slow(request: web.Request) -> web.Response:
            running[0] += 1
            most[0] = max(most[0], running[0])
            scraped[0] += 1
            await asyncio.sleep(0.2)
            running[0] -= 1
            return web.Response(text=TEXT, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", slow)
        inner, inner_port = await serve_locally(app)
        door, port = await serve_locally(make_metrics_door(inner_port))
        try:
            async with ClientSession() as session:
                async def get() -> tuple[int, str]:
                    async with session.get(f"http://127.0.0.1:{port}/metrics") as answer:
                        return answer.status, await answer.text()
                answers = await asyncio.gather(*(get() for _ in range(50)))
            assert answers == [(200, TEXT)] * 50
            assert most[0] == 1 and scraped[0] <= 3
        finally:
            await door.cleanup()
            await inner.cleanup()
    asyncio.run(main())

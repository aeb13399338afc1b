"""The metrics door: tritonserver's metrics port, on every role, answered in the HTTP
front's process and forwarded to tritonserver's metrics server, which listens on loopback
on a port of its own (:func:`launch.deploy.behind_door`).

Why: Triton 2.51's metrics server dies (SIGSEGV) on a POST of a ~16 MB form
(``application/x-www-form-urlencoded``, curl's default) to any path, and the metrics port is
reachable wherever Prometheus scrapes it: one request would restart a server and six
would take ``serve`` down. A scrape is a GET with no body; nothing else needs to pass.

Invariants: only ``GET /metrics`` (and ``HEAD``) with no body is forwarded, as a plain GET
of tritonserver's ``/metrics`` (no header, query or body of the caller's); a request with a
body is 400 and any other method or path is refused by aiohttp's router (405/404), none of
them read; one scrape at a time reaches tritonserver, and every request that comes while
it runs gets its answer (a flood of scrapes costs tritonserver one at a time and makes no
probe wait behind a queue of them); a scrape longer than ``SCRAPE_SECONDS`` is 504;
nothing is forwarded unless this user listens on the inner port
(:class:`~triton_disagg.front.door_guards.InnerOwner`). The answer (Prometheus text) comes
back with tritonserver's status and content type.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from triton_disagg.front.door_guards import UNREACHABLE, InnerOwner
from triton_disagg.triton.endpoints import LOOPBACK

SCRAPE_SECONDS = 10.0       # Prometheus' default scrape timeout
SCRAPE_SESSION = web.AppKey("scrape_session", aiohttp.ClientSession)


class SharedScrape:
    """One scrape of ``url`` at a time; a caller that comes while one runs gets that one's
    answer: tritonserver's status, body and content type, or the door's 502/504."""

    def __init__(self, url: str):
        self.url = url
        self._running: asyncio.Future[web.Response] | None = None

    async def answer(self, session: aiohttp.ClientSession) -> web.Response:
        if self._running is None:
            self._running = asyncio.ensure_future(self._scrape(session))
            self._running.add_done_callback(self._done)
        answer = await asyncio.shield(self._running)
        copy = web.Response(status=answer.status, body=answer.body)
        copy.headers["Content-Type"] = answer.headers["Content-Type"]
        return copy

    def _done(self, _: asyncio.Future[web.Response]) -> None:
        self._running = None

    async def _scrape(self, session: aiohttp.ClientSession) -> web.Response:
        try:
            async with session.get(self.url) as upstream:
                body = await upstream.read()
        except TimeoutError:
            return web.Response(status=504, text=f"no metrics within {SCRAPE_SECONDS:g} s\n")
        except aiohttp.ClientError:
            return web.Response(status=502, text=f"{UNREACHABLE}\n")
        answer = web.Response(status=upstream.status, body=body)
        answer.headers["Content-Type"] = upstream.headers.get("Content-Type", "text/plain")
        return answer


def make_metrics_door(inner_port: int, owner: InnerOwner | None = None) -> web.Application:
    """An aiohttp app answering ``GET /metrics`` from tritonserver's metrics on
    ``LOOPBACK:inner_port`` (module docstring)."""
    owner = owner or InnerOwner((inner_port,))
    shared = SharedScrape(f"http://{LOOPBACK}:{inner_port}/metrics")

    async def scrape(request: web.Request) -> web.Response:
        if request.body_exists:
            return web.Response(status=400, text="a metrics request has no body\n")
        if not await owner.ours():
            return web.Response(status=503, text=f"{UNREACHABLE} (its port is not this "
                                                 f"server's)\n")
        return await shared.answer(request.app[SCRAPE_SESSION])

    async def open_session(app: web.Application) -> None:
        app[SCRAPE_SESSION] = aiohttp.ClientSession(
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=SCRAPE_SECONDS))

    async def close_session(app: web.Application) -> None:
        await app[SCRAPE_SESSION].close()

    app = web.Application()
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_get("/metrics", scrape)          # and HEAD
    return app

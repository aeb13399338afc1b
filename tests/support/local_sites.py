"""In-process aiohttp sites on free loopback ports, for unit tests of the doors."""

from __future__ import annotations

import socket

from aiohttp import web


def free_port() -> int:
    """A loopback port nobody listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def serve_locally(app: web.Application) -> tuple[web.AppRunner, int]:
    """``app`` started on 127.0.0.1: (its runner, to clean up; its port)."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port

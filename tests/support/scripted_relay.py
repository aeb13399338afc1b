"""A relay of the HTTP front scripted in the test (no tritonserver), and the front's aiohttp
app run around it in this process, behind a test client (:func:`run`) or served on a
loopback port as its process serves it (:func:`served`, with its runner's caps and
timeouts): what the unit tests of the front use."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from aiohttp.test_utils import TestClient, TestServer

from triton_disagg.config.front_section import FrontConfig
from triton_disagg.front.http_front import _serve, make_app
from triton_disagg.engine.sequence import TokenEvent
from triton_disagg.front.orchestrator_call import RequestEncoder
from triton_disagg.launch.deploy import free_ports


class ScriptedRelay:
    """Answers every request with ``deltas`` (a :func:`response`, or an exception to raise there),
    one every ``pause`` s; records the request ids and whether each stream was left early."""

    def __init__(self, deltas, pause: float = 0.0, ready: str | None = None):
        self.deltas, self.pause, self.why_not_ready = deltas, pause, ready
        self.request_ids: list[str] = []
        self.left_early: list[bool] = []

    async def ready(self):
        return self.why_not_ready

    async def stream(self, inputs, request_id):
        self.request_ids.append(request_id)
        ended = False
        try:
            for item in self.deltas:
                await asyncio.sleep(self.pause)
                if isinstance(item, Exception):
                    raise item
                yield item
            ended = True
        finally:
            self.left_early.append(not ended)

    async def close(self):
        pass

    async def until_left(self, seconds: float = 15.0) -> None:
        """Wait until a stream was left early (asserted: exactly one)."""
        for _ in range(int(seconds / 0.05)):
            if self.left_early:
                break
            await asyncio.sleep(0.05)
        assert self.left_early == [True]


def response(text: str, prompt_tokens: int, completion_tokens: int, token_ids=(), log_probs=(),
             finish_reason=None, top=(), **fields) -> TokenEvent:
    """An orchestrator response as the HTTP front reads it (:func:`tensors.response_event`):
    ``text``, the counts and (when the request asked for log-probs) its tokens' ids and
    log-probs, their alternatives in ``top``; ``fields``: the event's other fields."""
    return TokenEvent("", list(token_ids), list(log_probs) if log_probs else None,
                      finish_reason, top=list(top) if top else None, text=text,
                      prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, **fields)


BODY = {"model": "demo", "prompt": "a", "max_tokens": 3}   # a completion for the demo front
WORDS = [response("Hello", 3, 1), response(" 世界", 3, 2), response(" 🎉", 3, 3, finish_reason="length")]


def run(relay, check, demo_engine, front: FrontConfig = FrontConfig(),
        bound_host: str = "127.0.0.1"):
    """``check(client)`` against the front of ``demo_engine``, its relay ``relay``."""
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
    """A plain connection to ``port``, ``data`` sent on it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if data:
        writer.write(data)
        await writer.drain()
    return reader, writer

"""A relay of the HTTP front scripted in the test (no tritonserver), and the front's aiohttp
app run around it in this process: what the unit tests of the front use."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer

from triton_disagg.front.http_front import make_app
from triton_disagg.front.prepare import RequestEncoder
from triton_disagg.front.relay import Delta


class ScriptedRelay:
    """Answers every request with ``deltas`` (a Delta, or an exception to raise there),
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


WORDS = [Delta("Hello", 3, 1), Delta(" 世界", 3, 2), Delta(" 🎉", 3, 3, finish_reason="length")]


def run(relay, check, demo_engine):
    """``check(client)`` against the front of ``demo_engine``, its relay ``relay``."""
    async def main():
        app = make_app(RequestEncoder(demo_engine, "demo"), relay)
        async with TestClient(TestServer(app, handler_cancellation=True)) as client:
            await check(client)
    asyncio.run(main())

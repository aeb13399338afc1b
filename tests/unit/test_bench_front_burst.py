"""`bench/front_burst.py` against the HTTP front's app in this process, its relay scripted
(tests/support/scripted_relay.py) and its request cap 1: it counts the refusals and the TTFTs."""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp.test_utils import TestServer

from waiting import wait_until
from scripted_relay import WORDS, ScriptedRelay
from triton_disagg.bench import front_burst
from triton_disagg.config.front_section import FrontConfig
from triton_disagg.front.http_front import make_app
from triton_disagg.front.orchestrator_call import RequestEncoder


def test_front_burst_counts_refusals_and_ttft(demo_engine, capsys):
    """The app (cap 1) serves on a thread of its own while ``front_burst`` bursts it."""
    ports, stopping = [], threading.Event()

    def serve():
        async def main():
            app = make_app(RequestEncoder(demo_engine, "demo"), ScriptedRelay(WORDS, pause=0.05),
                           FrontConfig(max_concurrent_requests=1))
            async with TestServer(app) as server:
                ports.append(server.port)
                while not stopping.is_set():
                    await asyncio.sleep(0.05)
        asyncio.run(main())
    thread = threading.Thread(target=serve)
    thread.start()
    try:
        wait_until(lambda: ports, 30, "the app serves", poll=0.05)
        front_burst.main(["--front", f"http://127.0.0.1:{ports[0]}", "--model", "demo",
                          "--cap", "1", "--burst", "16", "--every", "0.3", "--seconds", "1"])
    finally:
        stopping.set()
        thread.join()
    report = json.loads(capsys.readouterr().out)
    assert report["unloaded_ttft"]["n"] > 0 and report["burst_ttft_cap_fillers"]["n"] > 0
    assert report["burst_refused"]["n"] > 0 and report["other_statuses"] == {}

"""A scheduler whose generation server comes back after a long outage (issue 27, item 7):
ready within ``READY_WITHIN`` seconds of the server answering again, and from its first
``/healthz`` 200 on, every request served (no 503 after a 200).

Before ``triton_disagg.triton.grpc_channel`` the scheduler's cached gRPC channels backed
off up to 120 s between reconnection attempts: after a 6-minute outage it answered
``/healthz`` 200 only ~65 s after the server was back, and for 5-15 s after that its
requests still failed with "generation server ... was lost (UNAVAILABLE: Connection
refused)". ``OUTAGE_SECONDS`` of failing probes and requests are enough for the backoff
to pass 10 s."""

from __future__ import annotations

import time

import requests

from config_files import three_roles_config
import servers

OUTAGE_SECONDS = 45.0
READY_WITHIN = 5.0
REQUESTS_AFTER = 8


def _healthz(front: str) -> int:
    try:
        return requests.get(f"{front}/healthz", timeout=2).status_code
    except requests.RequestException:
        return 0


def _infer(front: str, model: str) -> requests.Response:
    return requests.post(f"{front}/v1/completions", timeout=60, json={
        "model": model, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0})


def test_a_returning_generation_server_makes_the_scheduler_ready_at_once(demo_engine, tmp_path):
    ctx_port, gen_port = servers.free_ports(2)
    config = three_roles_config(tmp_path, demo_engine, ctx_port, gen_port)
    args = ["-c", str(config)]
    model = demo_engine.name
    offline = servers.offline_text(demo_engine)("The quick brown fox", 8)
    with servers.serve("scheduler", args, tmp_path / "s", until="up (") as scheduler, \
            servers.serve("context", args, tmp_path / "c", http=False, grpc_port=ctx_port):
        with servers.serve("generation", args, tmp_path / "g1", http=False, grpc_port=gen_port):
            servers.wait_until(lambda: _healthz(scheduler.front) == 200, 30, "first ready")
            assert _infer(scheduler.front, model).status_code == 200
        outage_end = time.monotonic() + OUTAGE_SECONDS
        while time.monotonic() < outage_end:      # clients keep trying, as they would
            assert _healthz(scheduler.front) == 503
            assert _infer(scheduler.front, model).status_code in (502, 503, 504)
            time.sleep(1.0)
        with servers.serve("generation", args, tmp_path / "g2", http=False, grpc_port=gen_port):
            back = time.monotonic()            # its serve said ready: it answers
            took = servers.wait_until(lambda: _healthz(scheduler.front) == 200, 60,
                                      "ready after the outage", poll=0.05)
            print(f"scheduler ready {took:.2f} s after generation answered again "
                  f"({time.monotonic() - back:.2f} s)")
            assert took <= READY_WITHIN
            for _ in range(REQUESTS_AFTER):
                assert _healthz(scheduler.front) == 200
                response = _infer(scheduler.front, model)
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["text"] == offline

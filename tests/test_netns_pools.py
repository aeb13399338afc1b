"""Pools across hosts (network namespaces, :mod:`netns_hosts`), found through etcd: etcd,
the scheduler, two context servers and two generation servers each on a host of its
own, started with the commands a user runs (one config: ``discovery`` and no urls).

- 32 concurrent gRPC streams through the scheduler give the offline engine's greedy text,
  and every server took at least 25% of its role's share (the scheduler's
  ``disagg_routed_requests_total`` per server url);
- a third generation server started under load takes traffic within 2 s of being ready;
- a context server killed (every process on its host, SIGKILL) while still registered
  costs no request: a call routed to it is tried once on the other
  (``disagg_route_retries_total``), and it is passed over after that;
- the survivors' KV pools return to 0 blocks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import etcd_server
import serving
from netns_hosts import HeldStreams, Hosts, grpc_streams, hosts_fixture, metrics_of, serve_role
from triton_disagg.bench.serve_metrics import total

HOSTS = ("etcd", "scheduler", "ctx1", "ctx2", "gen1", "gen2", "gen3")
ROLE = {"ctx1": "context", "ctx2": "context", "gen1": "generation", "gen2": "generation",
        "gen3": "generation", "scheduler": "scheduler"}
ETCD_PORT, GRPC_PORT, SCHEDULER_GRPC, METRICS_PORT = 2379, 9001, 8001, 9100
MAX_TOKENS = 24
SHARE = 0.25        # every server takes at least this part of its role's even share
JOIN_BOUND = 2.0    # seconds from ready to its first request (the issue's bound)
LOAD = """
import json, os, sys
from concurrent.futures import ThreadPoolExecutor
import serving
url, stop, prompt, expected, workers = sys.argv[1:6]
def worker(_):
    wrong = []
    while not os.path.exists(stop):
        try:
            text = "".join(serving.grpc_stream(url, prompt, %d))
        except Exception as exc:
            text = f"error: {exc}"
        if text != expected:
            wrong.append(text)
    return wrong
with ThreadPoolExecutor(int(workers)) as pool:
    print(json.dumps([w for ws in pool.map(worker, range(int(workers))) for w in ws]))
""" % MAX_TOKENS
WATCH = """
import sys, time, urllib.request
from triton_disagg.bench.serve_metrics import total
url, server = sys.argv[1:3]
while not total(parse(urllib.request.urlopen(url).read().decode()),
                "disagg_routed_requests_total", server=server):
    time.sleep(0.05)
print(time.monotonic())
"""


hosts = hosts_fixture(HOSTS)


def _serve(hosts: Hosts, host: str, config, tmp_path) -> tuple:
    port = SCHEDULER_GRPC if host == "scheduler" else GRPC_PORT
    return serve_role(hosts, host, ROLE[host], config, tmp_path / host, port, METRICS_PORT)


def _metrics(hosts: Hosts, host: str):
    return metrics_of(hosts, host, METRICS_PORT)


def _routed(hosts: Hosts, host: str) -> float:
    """Calls the scheduler routed to ``host``'s server."""
    return total(_metrics(hosts, "scheduler"), "disagg_routed_requests_total",
                 server=f"{hosts.address(host)}:{GRPC_PORT}")


def _until(predicate, timeout: float, what: str) -> float:
    """Seconds until ``predicate()`` held, polled every 0.1 s."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"not within {timeout} s: {what}"
        time.sleep(0.1)
    return time.monotonic() - start


def test_pools_across_hosts_with_etcd(demo_engine, tmp_path, hosts, monkeypatch):
    from triton_disagg.kv.secret import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, "netns-pools-" + "7" * 32)   # as hosts apart must share it
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\n"
                      "context_server: {cpus: [0]}\ngeneration_server: {cpus: [1]}\n"
                      "kv_cache: {strategy: direct_transfer, max_size: 64MB}\n"
                      f"discovery: {{etcd: \"{hosts.address('etcd')}:{ETCD_PORT}\", "
                      "prefix: /netns-pools, ttl_seconds: 5}\n")
    offline = serving.offline_text(demo_engine)
    scheduler = f"{hosts.address('scheduler')}:{SCHEDULER_GRPC}"
    with open(tmp_path / "etcd.log", "wb") as log:
        hosts.popen("etcd", etcd_server.command(tmp_path / "etcd-data", hosts.address("etcd"),
                                                ETCD_PORT, ETCD_PORT + 1),
                    stdout=log, stderr=subprocess.STDOUT)
    first = ("scheduler", "ctx1", "ctx2", "gen1", "gen2")
    with contextlib.ExitStack() as stack:
        stack.enter_context(serving.serve_commands([_serve(hosts, h, config, tmp_path)
                                                    for h in first]))
        members = lambda role: total(_metrics(hosts, "scheduler"),  # noqa: E731
                                     "disagg_pool_members", server_role=role)
        _until(lambda: members("context") == members("generation") == 2, 5, "2 + 2 members")

        # 32 streams at once: the offline text, every server its share
        prompts = serving.PROMPTS * 8
        texts = grpc_streams(hosts, "scheduler", scheduler, MAX_TOKENS, prompts)
        assert texts == [offline(p, MAX_TOKENS) for p in prompts]
        routed = {h: _routed(hosts, h) for h in first[1:]}
        print(f"routed per server: {routed}")
        for pair in (("ctx1", "ctx2"), ("gen1", "gen2")):
            assert sum(routed[h] for h in pair) == len(prompts)       # none retried
            assert min(routed[h] for h in pair) >= SHARE * len(prompts) / 2, routed

        # a third generation server started under load takes traffic within 2 s
        stop_file = tmp_path / "stop-load"
        prompt = serving.PROMPTS[0]
        load = hosts.popen("scheduler", [sys.executable, "-c", LOAD, scheduler, str(stop_file),
                                         prompt, offline(prompt, MAX_TOKENS), "4"],
                           stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": os.path.dirname(__file__)})
        gen3 = f"{hosts.address('gen3')}:{GRPC_PORT}"
        metrics = f"http://{hosts.address('scheduler')}:{METRICS_PORT}/metrics"
        watch = hosts.popen("scheduler", [sys.executable, "-c", WATCH, metrics, gen3],
                            stdout=subprocess.PIPE, text=True)
        stack.enter_context(serving.serve_commands([_serve(hosts, "gen3", config, tmp_path)]))
        seen_ready = time.monotonic()            # CLOCK_MONOTONIC: one clock for every netns
        first_request = float(watch.communicate(timeout=30)[0])
        # the ready line is looked for every READY_POLL s: it came at most that much earlier
        joined = first_request - seen_ready + serving.READY_POLL
        print(f"gen3 took its first request at most {joined:.2f} s after it was ready")
        assert joined < JOIN_BOUND

        stop_file.touch()
        wrong = load.communicate(timeout=120)[0]
        assert wrong.strip() == "[]", wrong          # the load saw no error, no wrong text

        # a context server killed while registered: its calls go to the other one (no load
        # runs: generation's fetch of a handoff already made on it would fail the request)
        before = total(_metrics(hosts, "scheduler"), "disagg_route_retries_total")
        held = HeldStreams(hosts, "scheduler", scheduler, MAX_TOKENS, prompts[:8],
                           tmp_path / "go")          # they start well inside the 5 s lease
        for line in serving.processes_under(tmp_path / "ctx2"):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        assert held.texts() == [offline(p, MAX_TOKENS) for p in prompts[:8]]
        retries = total(_metrics(hosts, "scheduler"), "disagg_route_retries_total") - before
        print(f"context calls retried after ctx2 was killed: {retries:g}")
        assert retries >= 1

        survivors = ("ctx1", "gen1", "gen2", "gen3")
        _until(lambda: not any(total(_metrics(hosts, h), "disagg_kv_blocks_used")
                               for h in survivors), 30, "KV pools back to 0 blocks")

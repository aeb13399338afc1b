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
- the survivors' KV pools return to 0 blocks;
- a generation server stopped cleanly (SIGTERM) under load fails no request: it
  deregisters, takes no more requests and drains what it holds before it stops;
- etcd killed: serving goes on with the last known set (the scheduler says so in its log
  and ``disagg_etcd_reachable``), and once etcd restarts the registrations are back.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import etcd_server
import servers
from netns_hosts import (METRICS_PORT, ROLE_GRPC_PORT, SCHEDULER_GRPC_PORT, HeldStreams, Hosts,
                         grpc_streams, hosts_fixture, metrics_of, serve_role)
from servers import wait_until
from triton_disagg.routing.scrape import total

SUPPORT = Path(__file__).resolve().parents[1] / "support"   # the helpers, for LOAD
HOSTS = ("etcd", "scheduler", "ctx1", "ctx2", "gen1", "gen2", "gen3")
ROLE = {"ctx1": "context", "ctx2": "context", "gen1": "generation", "gen2": "generation",
        "gen3": "generation", "scheduler": "scheduler"}
ETCD_PORT = 2379
PREFIX, TTL = "/netns-pools", 5
LONG_TOKENS = 400   # streams that outlast a stopping server's 1 s notice
MAX_TOKENS = 24
SHARE = 0.25        # every server takes at least this part of its role's even share
JOIN_BOUND = 2.0    # seconds from ready to its first request (the issue's bound)
LOAD = """
import json, os, sys
from concurrent.futures import ThreadPoolExecutor
import servers
url, stop, prompt, expected, workers, max_tokens = sys.argv[1:7]
expected = json.loads(expected)     # JSON: a text may hold a NUL, which argv cannot
def worker(_):
    wrong = []
    while not os.path.exists(stop):
        try:
            text = "".join(servers.grpc_stream(url, prompt, int(max_tokens)))
        except Exception as exc:
            text = f"error: {exc}"
        if text != expected:
            wrong.append(text)
    return wrong
with ThreadPoolExecutor(int(workers)) as pool:
    print(json.dumps([w for ws in pool.map(worker, range(int(workers))) for w in ws]))
"""
WATCH = """
import sys, time, urllib.request
from triton_disagg.routing.scrape import parse_metrics, total
url, server = sys.argv[1:3]
while not total(parse_metrics(urllib.request.urlopen(url).read().decode()),
                "disagg_routed_requests_total", server=server):
    time.sleep(0.05)
print(time.monotonic())
"""


hosts = hosts_fixture(HOSTS)


def _serve(hosts: Hosts, host: str, config, tmp_path) -> tuple:
    return serve_role(hosts, host, ROLE[host], config, tmp_path / host)


def _routed(hosts: Hosts, host: str) -> float:
    """Calls the scheduler routed to ``host``'s server."""
    return total(metrics_of(hosts, "scheduler"), "disagg_routed_requests_total",
                 server=f"{hosts.address(host)}:{ROLE_GRPC_PORT}")




def _deployment(hosts: Hosts, engine, tmp_path, monkeypatch):
    """The config every host serves (discovery, no urls); the KV secret they share."""
    from triton_disagg.kv.secret import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, "netns-pools-" + "7" * 32)   # as hosts apart must share it
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {engine}}}\n"
                      "context_server: {cpus: [0]}\ngeneration_server: {cpus: [1]}\n"
                      "kv_cache: {strategy: direct_transfer, max_size: 64MB}\n"
                      f"discovery: {{etcd: \"{hosts.address('etcd')}:{ETCD_PORT}\", "
                      f"prefix: {PREFIX}, ttl_seconds: {TTL}}}\n")
    return config


def _start_etcd(hosts: Hosts, tmp_path) -> subprocess.Popen:
    """etcd on its host, on ``tmp_path``'s data dir (kept across restarts)."""
    with open(tmp_path / "etcd.log", "ab") as log:
        return hosts.popen("etcd", etcd_server.command(tmp_path / "etcd-data",
                                                       hosts.address("etcd"), ETCD_PORT,
                                                       ETCD_PORT + 1),
                           stdout=log, stderr=subprocess.STDOUT)


def _members(hosts: Hosts, role: str) -> float:
    return total(metrics_of(hosts, "scheduler"), "disagg_pool_members", server_role=role)


def _start_load(hosts: Hosts, offline, stop_file, workers: int,
                max_tokens: int = MAX_TOKENS) -> subprocess.Popen:
    """Clients on the scheduler's host streaming one prompt over and over until ``stop_file``
    exists; its output is the JSON list of every wrong text or error."""
    prompt = servers.PROMPTS[0]
    return hosts.popen("scheduler", [sys.executable, "-c", LOAD,
                                     f"{hosts.address('scheduler')}:{SCHEDULER_GRPC_PORT}",
                                     str(stop_file), prompt, json.dumps(offline(prompt, max_tokens)),
                                     str(workers), str(max_tokens)],
                       stdout=subprocess.PIPE, text=True,
                       env={**os.environ, "PYTHONPATH": str(SUPPORT)})


def test_pools_across_hosts_with_etcd(demo_engine, tmp_path, hosts, monkeypatch):
    config = _deployment(hosts, demo_engine, tmp_path, monkeypatch)
    offline = servers.offline_text(demo_engine)
    scheduler = f"{hosts.address('scheduler')}:{SCHEDULER_GRPC_PORT}"
    _start_etcd(hosts, tmp_path)
    first = ("scheduler", "ctx1", "ctx2", "gen1", "gen2")
    with contextlib.ExitStack() as stack:
        stack.enter_context(servers.serve_commands([_serve(hosts, h, config, tmp_path)
                                                    for h in first]))
        wait_until(lambda: _members(hosts, "context") == _members(hosts, "generation") == 2, 5,
               "2 + 2 members")

        # 32 streams at once: the offline text, every server its share
        prompts = servers.PROMPTS * 8
        texts = grpc_streams(hosts, "scheduler", scheduler, MAX_TOKENS, prompts)
        assert texts == [offline(p, MAX_TOKENS) for p in prompts]
        routed = {h: _routed(hosts, h) for h in first[1:]}
        print(f"routed per server: {routed}")
        for pair in (("ctx1", "ctx2"), ("gen1", "gen2")):
            assert sum(routed[h] for h in pair) == len(prompts)       # none retried
            assert min(routed[h] for h in pair) >= SHARE * len(prompts) / 2, routed

        # a third generation server started under load takes traffic within 2 s
        stop_file = tmp_path / "stop-load"
        load = _start_load(hosts, offline, stop_file, 4)
        gen3 = f"{hosts.address('gen3')}:{ROLE_GRPC_PORT}"
        metrics = f"http://{hosts.address('scheduler')}:{METRICS_PORT}/metrics"
        watch = hosts.popen("scheduler", [sys.executable, "-c", WATCH, metrics, gen3],
                            stdout=subprocess.PIPE, text=True)
        stack.enter_context(servers.serve_commands([_serve(hosts, "gen3", config, tmp_path)]))
        seen_ready = time.monotonic()            # CLOCK_MONOTONIC: one clock for every netns
        first_request = float(watch.communicate(timeout=30)[0])
        # the ready line is looked for every READY_POLL s: it came at most that much earlier
        joined = first_request - seen_ready + servers.READY_POLL
        print(f"gen3 took its first request at most {joined:.2f} s after it was ready")
        assert joined < JOIN_BOUND

        stop_file.touch()
        wrong = load.communicate(timeout=120)[0]
        assert wrong.strip() == "[]", wrong          # the load saw no error, no wrong text

        # a context server killed while registered: its calls go to the other one (no load
        # runs: generation's fetch of a handoff already made on it would fail the request)
        before = total(metrics_of(hosts, "scheduler"), "disagg_route_retries_total")
        held = HeldStreams(hosts, "scheduler", scheduler, MAX_TOKENS, prompts[:8],
                           tmp_path / "go")          # they start well inside the 5 s lease
        for line in servers.processes_under(tmp_path / "ctx2"):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        assert held.texts() == [offline(p, MAX_TOKENS) for p in prompts[:8]]
        retries = total(metrics_of(hosts, "scheduler"), "disagg_route_retries_total") - before
        print(f"context calls retried after ctx2 was killed: {retries:g}")
        assert retries >= 1

        survivors = ("ctx1", "gen1", "gen2", "gen3")
        wait_until(lambda: not any(total(metrics_of(hosts, h), "disagg_kv_blocks_used")
                               for h in survivors), 30, "KV pools back to 0 blocks")


def test_a_generation_server_stopped_cleanly_under_load_fails_no_request(
        demo_engine, tmp_path, hosts, monkeypatch):
    """SIGTERM to one generation server's ``serve`` under load: it deregisters, the
    scheduler routes nothing more to it, what it holds finishes (it drains before it stops
    tritonserver), and the clients see no error and no wrong text."""
    config = _deployment(hosts, demo_engine, tmp_path, monkeypatch)
    offline = servers.offline_text(demo_engine)
    _start_etcd(hosts, tmp_path)
    first = ("scheduler", "ctx1", "gen1", "gen2")
    with servers.serve_commands([_serve(hosts, h, config, tmp_path) for h in first]) as served:
        wait_until(lambda: _members(hosts, "generation") == 2, 5, "2 generation members")
        stop_file = tmp_path / "stop-load"
        load = _start_load(hosts, offline, stop_file, 4, LONG_TOKENS)
        wait_until(lambda: _routed(hosts, "gen2") >= 2, 60, "gen2 takes requests under load")
        gen2 = served[first.index("gen2")]
        assert servers.stop(gen2) == 0                 # SIGTERM, then serve exits by itself
        assert _members(hosts, "generation") == 1
        routed = _routed(hosts, "gen2")
        served_by_gen1 = _routed(hosts, "gen1")
        wait_until(lambda: _routed(hosts, "gen1") >= served_by_gen1 + 4, 60, "the load goes on")
        assert _routed(hosts, "gen2") == routed        # nothing routed there once it stopped
        stop_file.touch()
        wrong = load.communicate(timeout=120)[0]
        assert wrong.strip() == "[]", wrong            # no error, no wrong text
        said = [line for line in gen2.log.read_text().splitlines() if "drain" in line]
        print("gen2: " + "; ".join(said))
        # it held streams that outlasted the notice, and let them finish
        assert "live sequences" in said[0] and "drained in" in said[-1], said


REGISTERED = """
import sys
from triton_disagg.config.discovery_section import DiscoveryConfig
from triton_disagg.routing.discovery.etcd import connect
etcd, prefix = sys.argv[1:3]
client = connect(DiscoveryConfig(etcd=etcd, prefix=prefix, ttl_seconds=5), timeout=2)
print(" ".join(sorted(meta["key"].decode() for _, meta in client.get_prefix(prefix + "/"))))
"""


def test_etcd_killed_serving_goes_on_and_registrations_come_back(
        demo_engine, tmp_path, hosts, monkeypatch):
    """``kill -9`` of etcd: the scheduler says so (log, ``disagg_etcd_reachable`` 0) and
    serves on the last known set, past the lease TTL; etcd restarted on its data dir: the
    scheduler says it answers again, and both servers are registered there, their leases
    kept alive by their heartbeats (still there a TTL later)."""
    config = _deployment(hosts, demo_engine, tmp_path, monkeypatch)
    offline = servers.offline_text(demo_engine)
    scheduler = f"{hosts.address('scheduler')}:{SCHEDULER_GRPC_PORT}"
    etcd = _start_etcd(hosts, tmp_path)
    first = ("scheduler", "ctx1", "gen1")
    etcd_url = f"{hosts.address('etcd')}:{ETCD_PORT}"
    keys = " ".join(sorted(f"{PREFIX}/{ROLE[h]}/{hosts.address(h)}:{ROLE_GRPC_PORT}"
                           for h in first[1:]))
    registered = lambda: hosts.python("scheduler", REGISTERED, etcd_url, PREFIX).strip()  # noqa: E731
    reachable = lambda: total(metrics_of(hosts, "scheduler"), "disagg_etcd_reachable")  # noqa: E731
    prompts = servers.PROMPTS
    with servers.serve_commands([_serve(hosts, h, config, tmp_path) for h in first]) as served:
        wait_until(lambda: _members(hosts, "context") == _members(hosts, "generation") == 1, 5,
               "1 + 1 members")
        assert registered() == keys and reachable() == 1

        etcd.kill()                                    # SIGKILL: ip netns exec exec'd etcd
        etcd.wait()
        wait_until(lambda: reachable() == 0, 5, "the scheduler sees etcd gone")
        time.sleep(TTL + 1)                            # past every lease: nothing lapses here
        assert grpc_streams(hosts, "scheduler", scheduler, MAX_TOKENS, prompts) == \
            [offline(p, MAX_TOKENS) for p in prompts]
        assert _members(hosts, "context") == _members(hosts, "generation") == 1
        log = (served[0].work_dir / "tritonserver.log").read_text(errors="replace")
        assert f"etcd at {etcd_url} does not answer" in log
        assert "keeping the last known members (1 context, 1 generation)" in log

        _start_etcd(hosts, tmp_path)
        wait_until(lambda: reachable() == 1, 15, "the scheduler sees etcd back")
        wait_until(lambda: registered() == keys, 10, "both servers registered again")
        time.sleep(TTL + 1)                            # their heartbeats keep the leases
        assert registered() == keys
        log = (served[0].work_dir / "tritonserver.log").read_text(errors="replace")
        assert f"etcd at {etcd_url} answers again; members: 1 context, 1 generation" in log
        assert grpc_streams(hosts, "scheduler", scheduler, MAX_TOKENS, prompts) == \
            [offline(p, MAX_TOKENS) for p in prompts]

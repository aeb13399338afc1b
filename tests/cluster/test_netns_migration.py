"""A generation server lost mid-stream, across hosts (network namespaces, :mod:`netns_hosts`):
the scheduler, a context server and two generation servers, each on a host of its own,
static pools (``urls``), started with the commands a user runs.

- ``kill -9`` of gen1's tritonserver while 16 streams run on both generation servers:
  every stream completes with the offline engine's greedy text, none missing or
  repeating a token (those on gen1 migrate: context prefills the prompt plus what was
  sent, gen2 decodes the rest), the scheduler counts the migrations
  (``disagg_migrations_total``), and the survivors' KV pools return to 0 blocks (what
  gen1 never fetched is given back or reclaimed by lease on the context side);
- then with gen1 stopped for good, ``kill -9`` of gen2's whole server mid-stream: no
  generation server is left, and every stream fails within 5 s of the kill with one line
  naming a generation server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import servers
from netns_hosts import (ROLE_GRPC_PORT, SCHEDULER_GRPC_PORT, HeldStreams, Hosts, hosts_fixture,
                         metrics_of, serve_role)
from servers import wait_until
from triton_disagg.routing.scrape import total

HOSTS = ("scheduler", "ctx1", "gen1", "gen2")
ROLE = {"scheduler": "scheduler", "ctx1": "context", "gen1": "generation", "gen2": "generation"}
MAX_TOKENS = 96
LEASE_SECONDS = 5
FAIL_BOUND = 5.0    # seconds from the kill to a client's error when no server is left


hosts = hosts_fixture(HOSTS)


def _serve(hosts: Hosts, host: str, config, tmp_path) -> tuple:
    return serve_role(hosts, host, ROLE[host], config, tmp_path / host)


def _kill(work_dir, only: str = "") -> None:
    """SIGKILL the processes of a server (those whose command line holds ``only``)."""
    for line in servers.processes_under(work_dir):
        if only in line:
            os.kill(int(line.split(":")[0]), signal.SIGKILL)




def test_a_generation_server_lost_mid_stream(demo_engine, tmp_path, hosts, monkeypatch):
    from triton_disagg.kv.secret import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, "netns-migration-" + "5" * 32)   # hosts apart share it
    url = {h: f"{hosts.address(h)}:{ROLE_GRPC_PORT}" for h in ("ctx1", "gen1", "gen2")}
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\n"
                      f"context_server: {{urls: [\"{url['ctx1']}\"], cpus: [0]}}\n"
                      f"generation_server: {{urls: [\"{url['gen1']}\", \"{url['gen2']}\"], "
                      "cpus: [1]}\n"
                      f"kv_cache: {{strategy: direct_transfer, max_size: 64MB, "
                      f"lease_seconds: {LEASE_SECONDS}}}\n")
    offline = servers.offline_text(demo_engine)
    scheduler = f"{hosts.address('scheduler')}:{SCHEDULER_GRPC_PORT}"
    prompts = servers.PROMPTS * 4
    expected = [offline(p, MAX_TOKENS) for p in prompts]
    routed = lambda host: total(metrics_of(hosts, "scheduler"),  # noqa: E731
                                "disagg_routed_requests_total", server=url[host])
    with contextlib.ExitStack() as stack:
        running = stack.enter_context(servers.serve_commands(
            [_serve(hosts, h, config, tmp_path) for h in HOSTS]))

        # kill -9 of gen1's tritonserver once it holds streams: they move to gen2
        held = HeldStreams(hosts, "scheduler", scheduler, MAX_TOKENS, prompts, tmp_path / "go")
        held.start()
        wait_until(lambda: routed("gen1") >= 4, 30, "gen1 holds streams")
        _kill(tmp_path / "gen1", only="bin/tritonserver")
        assert held.texts() == expected
        migrations = total(metrics_of(hosts, "scheduler"), "disagg_migrations_total",
                           server=url["gen1"])
        print(f"streams migrated off gen1: {migrations:g}")
        assert migrations >= 1
        wait_until(lambda: not any(total(metrics_of(hosts, h), "disagg_kv_blocks_used")
                               for h in ("ctx1", "gen2")), 2 * LEASE_SECONDS + 10,
               "KV pools of ctx1 and gen2 back to 0 blocks")

        # no generation server left: one clear line within 5 s of the kill
        servers.stop(running[HOSTS.index("gen1")])
        before = routed("gen2")
        # 4 streams decode fast: long ones, so none ends before the kill lands
        held = HeldStreams(hosts, "scheduler", scheduler, 4 * MAX_TOKENS, prompts[:4],
                           tmp_path / "go-again")
        held.start()
        wait_until(lambda: routed("gen2") >= before + 4, 30, "gen2 holds the streams")
        _kill(tmp_path / "gen2")
        killed = time.monotonic()            # CLOCK_MONOTONIC: one clock for every netns
        outcomes = held.outcomes()
        for outcome in outcomes:
            error = outcome["error"] or ""
            lost = [u for u in (url["gen1"], url["gen2"])
                    if f"generation server {u} was lost" in error]
            assert lost and "\n" not in error.strip(), outcome
            assert outcome["ended"] - killed < FAIL_BOUND, outcome
        print(f"errors after the last generation server died: {outcomes[0]['error']}")

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

With the scheduler's ``--overlap_kv_transfer`` generation is asked first and reads the KV
while the context prefills it: ``kill -9`` of gen1 (every process) while it holds requests
whose long prompts are still being prefilled (ctx1 held still by SIGSTOP meanwhile, so their
KV is in transfer) moves them to gen2 with the same greedy text, at least one of them before
its second token, and ctx1's and gen2's pools return to 0 blocks.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import servers
from netns_hosts import (ROLE_GRPC_PORT, SCHEDULER_GRPC_PORT, HeldStreams, Hosts, hosts_fixture,
                         metrics_of, serve_role)
from servers import wait_until
from triton_disagg.routing.scrape import total

HOSTS = ("scheduler", "ctx1", "gen1", "gen2")
OVERLAP_FLAG = "--overlap_kv_transfer"
ROLE = {"scheduler": "scheduler", "ctx1": "context", "gen1": "generation", "gen2": "generation"}
MAX_TOKENS = 96
LEASE_SECONDS = 5
FAIL_BOUND = 5.0    # seconds from the kill to a client's error when no server is left
LONG_PROMPT_TOKENS = 1000   # prefills long enough that gen1 dies with their KV in transfer
OVERLAP_MAX_TOKENS = 32
MOVED = re.compile(r"moves on after (\d+) tokens")   # the orchestrator's line per migration


hosts = hosts_fixture(HOSTS)


def _serve(hosts: Hosts, host: str, config, tmp_path, flags: tuple[str, ...] = ()) -> tuple:
    cmd, *rest = serve_role(hosts, host, ROLE[host], config, tmp_path / host)
    return (cmd + list(flags), *rest)


def _config(demo_engine, tmp_path, url: dict[str, str]):
    """ctx1 and two generation servers as static pools, leases of ``LEASE_SECONDS``."""
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\n"
                      f"context_server: {{urls: [\"{url['ctx1']}\"], cpus: [0]}}\n"
                      f"generation_server: {{urls: [\"{url['gen1']}\", \"{url['gen2']}\"], "
                      "cpus: [1]}\n"
                      f"kv_cache: {{strategy: direct_transfer, max_size: 64MB, "
                      f"lease_seconds: {LEASE_SECONDS}}}\n")
    return config


def _kill(work_dir, only: str = "") -> None:
    """SIGKILL the processes of a server (those whose command line holds ``only``)."""
    for line in servers.processes_under(work_dir):
        if only in line:
            os.kill(int(line.split(":")[0]), signal.SIGKILL)




def test_a_generation_server_lost_mid_stream(demo_engine, tmp_path, hosts, monkeypatch):
    from triton_disagg.kv.secret import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, "netns-migration-" + "5" * 32)   # hosts apart share it
    url = {h: f"{hosts.address(h)}:{ROLE_GRPC_PORT}" for h in ("ctx1", "gen1", "gen2")}
    config = _config(demo_engine, tmp_path, url)
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
        # 4 long streams, killed as soon as each decodes (its second piece came): a
        # scrape of the routed count takes longer than a quiet machine's whole stream
        held = HeldStreams(hosts, "scheduler", scheduler, 4 * MAX_TOKENS, prompts[:4],
                           tmp_path / "go-again")
        held.start()
        held.wait_flowing()
        _kill(tmp_path / "gen2")
        killed = time.monotonic()            # CLOCK_MONOTONIC: one clock for every netns
        assert routed("gen2") >= before + 4, "the streams went to gen2"
        outcomes = held.outcomes()
        for outcome in outcomes:
            error = outcome["error"] or ""      # the kind and request id, no server url
            named = [u for u in (url["gen1"], url["gen2"]) if u in error]
            assert "unavailable now" in error and not named, outcome
            assert "\n" not in error.strip(), outcome
            assert outcome["ended"] - killed < FAIL_BOUND, outcome
        print(f"errors after the last generation server died: {outcomes[0]['error']}")


def test_a_generation_server_lost_during_overlapped_transfers(demo_engine, tmp_path, hosts,
                                                              monkeypatch):
    import random

    from triton_disagg.clients.workload import make_prompt
    from triton_disagg.front.tokenizer import Tokenizer
    from triton_disagg.kv.secret import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, "netns-migration-" + "6" * 32)
    url = {h: f"{hosts.address(h)}:{ROLE_GRPC_PORT}" for h in ("ctx1", "gen1", "gen2")}
    config = _config(demo_engine, tmp_path, url)
    rng, tokenizer = random.Random(20), Tokenizer(demo_engine)
    prompts = [make_prompt(LONG_PROMPT_TOKENS, rng, tokenizer) for _ in range(6)]
    scheduler = f"{hosts.address('scheduler')}:{SCHEDULER_GRPC_PORT}"
    routed = lambda host: total(metrics_of(hosts, "scheduler"),  # noqa: E731
                                "disagg_routed_requests_total", server=url[host])
    with servers.serve_commands([_serve(hosts, h, config, tmp_path,
                                        (OVERLAP_FLAG,) if h == "scheduler" else ())
                                 for h in HOSTS]):
        held = HeldStreams(hosts, "scheduler", scheduler, OVERLAP_MAX_TOKENS, prompts,
                           tmp_path / "go")
        held.start()
        # generation is asked first: gen1 holds requests before ctx1 has prefilled them;
        # ctx1 is held still while gen1 dies, so they are in transfer then, however fast
        wait_until(lambda: routed("gen1") >= 2, 30, "gen1 holds overlapped requests")
        context = servers.tritonserver_pid(tmp_path / "ctx1")
        os.killpg(context, signal.SIGSTOP)
        try:
            _kill(tmp_path / "gen1")                  # its NIXL agent too, at once
            wait_until(lambda: not servers.processes_under(tmp_path / "gen1"), 10,
                       "gen1's processes gone")
        finally:
            os.killpg(context, signal.SIGCONT)
        texts = held.texts()
        log = (tmp_path / "scheduler" / "tritonserver.log").read_text(errors="replace")
        moved = [int(n) for n in MOVED.findall(log)]
        print(f"requests moved off gen1 after n tokens: {sorted(moved)}")
        assert moved and min(moved) <= 1, moved     # one left gen1 with its KV in transfer
        wait_until(lambda: not any(total(metrics_of(hosts, h), "disagg_kv_blocks_used")
                                   for h in ("ctx1", "gen2")), 2 * LEASE_SECONDS + 10,
                   "KV pools of ctx1 and gen2 back to 0 blocks")
    offline = servers.offline_text(demo_engine)       # after the servers: the cores are free
    assert texts == [offline(p, OVERLAP_MAX_TOKENS) for p in prompts]

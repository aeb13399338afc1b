"""A context server cut off the network mid-transfer, with ``--overlap_kv_transfer``, across
hosts (network namespaces, :mod:`netns_hosts`): the scheduler, two context servers and one
generation server, each on a host of its own, static pools (``urls``), context requests
routed round robin, started with the commands a user runs.

Long prompts stream at once through the scheduler. Generation is asked first, so it holds
every request and reads each prompt's KV while its context server prefills it. Once ctx1
holds requests it is held still (SIGSTOP) and its ``eth0`` pulled out, then let go: its
prefills go on with nowhere to send their KV. ctx1's uplink is slowed (``tc``'s token
bucket) and the cut waits for its KV to be on the wire, so a READ is in flight when it
lands. Then:

- only ctx1's requests may fail (at most as many streams as went to ctx1), each with a
  one-line error; every other stream completes with the offline engine's greedy text;
- no stream hangs: each ends within the deadline (``stall_seconds``) plus the KV lease;
- with ctx1 back on the network, every pool (ctx1, ctx2, gen1) returns to 0 blocks used
  once the leases expire, and a new request through ctx1 completes.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

import servers
from netns_hosts import (ROLE_GRPC_PORT, SCHEDULER_GRPC_PORT, HeldStreams, grpc_streams,
                         hosts_fixture, metrics_of, serve_role)
from servers import wait_until
from triton_disagg.routing.scrape import total

HOSTS = ("scheduler", "ctx1", "ctx2", "gen1")
ROLE = {"scheduler": "scheduler", "ctx1": "context", "ctx2": "context", "gen1": "generation"}
PROMPT_TOKENS = 1000     # prefills long enough to cut ctx1 off in the middle of them
STREAMS = 8                # 4 per context: ctx2 still has prompts to start at the cut
MAX_TOKENS = 16
SLOW_LINK = "20mbit"      # ctx1's uplink: its KV (4 MB a prompt) arrives slower than made
READ_UNDER_WAY = 1 << 20  # bytes out of ctx1 once the streams began: a READ is in flight
LEASE_SECONDS = 10        # ctx1's slow reads fit in it when nothing is cut
STALL_SECONDS = 8
END_BOUND = STALL_SECONDS + 2 * LEASE_SECONDS + 10   # cut to every stream ended, at most


hosts = hosts_fixture(HOSTS)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "bug in kv/overlap.py: LayerReader runs every overlapped pull of an instance on one "
    "thread, and a READ from the cut-off ctx1 holds it until that pull's deadline, so ctx2's "
    "streams fail too ('generation sent no token for 8 s', 'no handle from the context "
    "within 10.0 s', 'NIXL READ ... did not finish in time (state PROC)')"))
def test_a_context_server_cut_off_mid_transfer_fails_only_its_requests(demo_engine, tmp_path,
                                                                        hosts, monkeypatch):
    from triton_disagg.clients.workload import make_prompt
    from triton_disagg.engine.tokenizer import Tokenizer
    from triton_disagg.kv.secret import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, "netns-overlap-cutoff-" + "7" * 32)
    url = {h: f"{hosts.address(h)}:{ROLE_GRPC_PORT}" for h in ("ctx1", "ctx2", "gen1")}
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\n"
                      f"context_server: {{urls: [\"{url['ctx1']}\", \"{url['ctx2']}\"], "
                      "router: round_robin, cpus: [0]}\n"
                      f"generation_server: {{urls: [\"{url['gen1']}\"], cpus: [1], "
                      f"stall_seconds: {STALL_SECONDS}}}\n"
                      f"kv_cache: {{strategy: direct_transfer, max_size: 64MB, "
                      f"lease_seconds: {LEASE_SECONDS}, overlap_transfer: true}}\n")
    rng, tokenizer = random.Random(21), Tokenizer(demo_engine)
    prompts = [make_prompt(PROMPT_TOKENS, rng, tokenizer) for _ in range(STREAMS)]
    scheduler = f"{hosts.address('scheduler')}:{SCHEDULER_GRPC_PORT}"
    routed = lambda host: total(metrics_of(hosts, "scheduler"),  # noqa: E731
                                "disagg_routed_requests_total", server=url[host])


    def pools_empty() -> bool:
        """ctx1, ctx2 and gen1 report 0 KV blocks used (False while one cannot be read:
        ctx1 is back on the network only just now)."""
        try:
            return not any(total(metrics_of(hosts, h), "disagg_kv_blocks_used")
                           for h in ("ctx1", "ctx2", "gen1"))
        except AssertionError:
            return False

    commands = [serve_role(hosts, h, ROLE[h], config, tmp_path / h) for h in HOSTS]
    commands = [(c[0] + ["--log-format", "json"], *c[1:]) for c in commands]
    with servers.serve_commands(commands):
        # one request through each context first: gen1 knows both, and NIXL has connected
        warm = grpc_streams(hosts, "scheduler", scheduler, MAX_TOKENS, ["warm up", "warm up"])
        held = HeldStreams(hosts, "scheduler", scheduler, MAX_TOKENS, prompts, tmp_path / "go")
        warm_on_ctx1 = routed("ctx1")
        hosts.throttle("ctx1", SLOW_LINK)
        sent = hosts.tx_bytes("ctx1")
        held.start()
        wait_until(lambda: routed("ctx1") >= warm_on_ctx1 + 2, 30, "ctx1 holds requests")
        wait_until(lambda: hosts.tx_bytes("ctx1") - sent > READ_UNDER_WAY, 30,
                   "gen1 reads ctx1's KV", poll=0.1)
        context = servers.tritonserver_pid(tmp_path / "ctx1")
        os.killpg(context, signal.SIGSTOP)            # mid-prefill: its KV partly announced
        try:
            hosts.link("ctx1", up=False)
        finally:
            os.killpg(context, signal.SIGCONT)
        cut = time.monotonic()                        # CLOCK_MONOTONIC: one clock for all
        outcomes = held.outcomes(timeout=END_BOUND + 30)
        on_ctx1 = routed("ctx1") - warm_on_ctx1
        hosts.link("ctx1", up=True)
        wait_until(pools_empty, 2 * LEASE_SECONDS + 10, "every KV pool back to 0 blocks",
                   poll=0.5)
        after = grpc_streams(hosts, "scheduler", scheduler, MAX_TOKENS, prompts[:2])
    offline = servers.offline_text(demo_engine)       # after the servers: the cores are free
    assert warm == [offline("warm up", MAX_TOKENS)] * 2
    assert after == [offline(p, MAX_TOKENS) for p in prompts[:2]]
    failed = [o["error"] for o in outcomes if o["error"]]
    print(f"{len(failed)} of {STREAMS} streams failed; {on_ctx1:g} of them went to ctx1; "
          f"errors: {failed}")
    for prompt, outcome in zip(prompts, outcomes):
        assert outcome["ended"] - cut < END_BOUND, outcome
        if outcome["error"] is None:
            assert outcome["text"] == offline(prompt, MAX_TOKENS)
        else:
            assert "\n" not in outcome["error"].strip(), outcome
    assert on_ctx1 < STREAMS and len(failed) <= on_ctx1, failed     # ctx2's all finished

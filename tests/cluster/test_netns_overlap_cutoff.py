"""A context server cut off the network mid-transfer, with ``--overlap_kv_transfer``, across
hosts (network namespaces, :mod:`netns_hosts`): two context servers and one generation
server, each on a host of its own, static pools (``urls``), started with the commands a user
runs. ``scheduler`` routes context calls over ctx1 and ctx2 (round robin); ``sched2``
knows ctx2 alone, so its requests never touch ctx1.

Long prompts stream at once through ``scheduler``. Generation is asked first, so it holds every
request and reads each prompt's KV while its context server prefills it. ctx1's uplink is
slowed (``tc``'s token bucket) so that its KV arrives slower than it is made: gen1 always
has some of it to read. Once ctx1 holds requests and its KV is flowing, its ``eth0`` is
pulled out: its prefills go on with nowhere to send their KV. Right then, long prompts
stream through ``sched2`` (ctx2 and gen1). Then:

- ``sched2``'s streams, which share nothing with ctx1 but gen1, complete with the offline
  engine's greedy text within their ``stall_seconds`` (``SCHED2_STALL_SECONDS``);
- of ``scheduler``'s streams at most as many fail as went to ctx1, each with a one-line
  error; the others complete with the greedy text; none hangs (each ends within the
  deadline plus twice the KV lease after the cut);
- with ctx1 back on the network, every pool (ctx1, ctx2, gen1) returns to 0 blocks used
  once the leases expire, and new requests through ``scheduler`` complete.

gen1 reads each context agent's KV on a thread of that agent's own
(:class:`triton_disagg.kv.layer_reader.LayerReader`): the READ stuck on ctx1 holds up only ctx1's
requests.
"""

from __future__ import annotations

import random
import time


import servers
from netns_hosts import (ROLE_GRPC_PORT, SCHEDULER_GRPC_PORT, HeldStreams, grpc_streams,
                         hosts_fixture, metrics_of, serve_role)
from servers import wait_until
from triton_disagg.routing.scrape import total

HOSTS = ("scheduler", "sched2", "ctx1", "ctx2", "gen1")
ROLE = {"scheduler": "scheduler", "sched2": "scheduler", "ctx1": "context", "ctx2": "context",
        "gen1": "generation"}
PROMPT_TOKENS = 1000      # prefills long enough to cut ctx1 off in the middle of them
STREAMS = 8               # through scheduler: 4 per context
SCHED2_STREAMS = 2
MAX_TOKENS = 16
SLOW_LINK_MBIT = 40       # ctx1's uplink: its KV (4 MB a prompt) arrives slower than made
READ_UNDER_WAY = 1 << 20  # bytes out of ctx1 once the streams began: a READ is in flight
FLOWING = 200_000         # bytes per 0.1 s out of ctx1 (40mbit: 500 kB): a READ under way
LEASE_SECONDS = 10        # ctx1's slow reads fit in it when nothing is cut
STALL_SECONDS = 8
SCHED2_STALL_SECONDS = 6  # over what ctx1's slow READs delay gen1 when nothing is cut
END_BOUND = STALL_SECONDS + 2 * LEASE_SECONDS + 10   # cut to every stream ended, at most


hosts = hosts_fixture(HOSTS)


def _config(path, demo_engine, contexts: list[str], generation: str, stall: int):
    path.write_text(f"model: {{engine: {demo_engine}}}\n"
                    f"context_server: {{urls: {contexts}, router: round_robin, cpus: [0]}}\n"
                    f"generation_server: {{urls: [\"{generation}\"], cpus: [1], "
                    f"stall_seconds: {stall}}}\n"
                    f"kv_cache: {{strategy: direct_transfer, max_size: 64MB, "
                    f"lease_seconds: {LEASE_SECONDS}, overlap_transfer: true}}\n")
    return path


def test_a_context_server_cut_off_mid_transfer_fails_only_its_requests(demo_engine, tmp_path,
                                                                        hosts, monkeypatch):
    from triton_disagg.clients.workload import make_prompt
    from triton_disagg.front.tokenizer import Tokenizer
    from triton_disagg.kv.secret import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, "netns-overlap-cutoff-" + "7" * 32)
    url = {h: f"{hosts.address(h)}:{ROLE_GRPC_PORT}" for h in ("ctx1", "ctx2", "gen1")}
    both = _config(tmp_path / "sched.yaml", demo_engine, [url["ctx1"], url["ctx2"]],
                   url["gen1"], STALL_SECONDS)
    ctx2_only = _config(tmp_path / "sched2.yaml", demo_engine, [url["ctx2"]], url["gen1"],
                        SCHED2_STALL_SECONDS)
    rng, tokenizer = random.Random(21), Tokenizer(demo_engine)
    prompts = [make_prompt(PROMPT_TOKENS, rng, tokenizer) for _ in range(STREAMS)]
    prompts2 = [make_prompt(PROMPT_TOKENS, rng, tokenizer) for _ in range(SCHED2_STREAMS)]
    sched, sched2 = (f"{hosts.address(h)}:{SCHEDULER_GRPC_PORT}" for h in ("scheduler", "sched2"))
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

    def reading_ctx1() -> bool:
        """ctx1 is sending KV now: its uplink moved over ``FLOWING`` bytes in 0.1 s."""
        before = hosts.tx_bytes("ctx1")
        time.sleep(0.1)
        return hosts.tx_bytes("ctx1") - before > FLOWING

    commands = [serve_role(hosts, h, ROLE[h], ctx2_only if h == "sched2" else both,
                           tmp_path / h) for h in HOSTS]
    with servers.serve_commands(commands):
        # one request through each context first: gen1 knows both, and NIXL has connected
        warm = grpc_streams(hosts, "scheduler", sched, MAX_TOKENS, ["warm up", "warm up"])
        held = HeldStreams(hosts, "scheduler", sched, MAX_TOKENS, prompts, tmp_path / "go")
        held2 = HeldStreams(hosts, "sched2", sched2, MAX_TOKENS, prompts2, tmp_path / "go2")
        warm_on_ctx1 = routed("ctx1")
        hosts.shape("ctx1", SLOW_LINK_MBIT)
        sent = hosts.tx_bytes("ctx1")
        held.start()
        wait_until(lambda: routed("ctx1") >= warm_on_ctx1 + 2, 30, "ctx1 holds requests")
        wait_until(lambda: hosts.tx_bytes("ctx1") - sent > READ_UNDER_WAY, 30,
                   "gen1 reads ctx1's KV", poll=0.1)
        wait_until(lambda: reading_ctx1(), 30, "a READ from ctx1 under way")
        hosts.link("ctx1", up=False)                  # mid-READ, mid-prefill
        cut = time.monotonic()                        # CLOCK_MONOTONIC: one clock for all
        held2.start()
        outcomes2 = held2.outcomes(timeout=END_BOUND + 30)
        outcomes = held.outcomes(timeout=END_BOUND + 30)
        on_ctx1 = routed("ctx1") - warm_on_ctx1
        hosts.link("ctx1", up=True)
        wait_until(pools_empty, 2 * LEASE_SECONDS + 10, "every KV pool back to 0 blocks",
                   poll=0.5)
        after = grpc_streams(hosts, "scheduler", sched, MAX_TOKENS, prompts[:2])
    offline = servers.offline_text(demo_engine)       # after the servers: the cores are free
    assert warm == [offline("warm up", MAX_TOKENS)] * 2
    assert after == [offline(p, MAX_TOKENS) for p in prompts[:2]]
    failed = [o["error"] for o in outcomes if o["error"]]
    print(f"scheduler: {len(failed)} of {STREAMS} streams failed, {on_ctx1:g} went to ctx1; "
          f"sched2 (ctx2 only): {[o['error'] for o in outcomes2]}")
    for prompt, outcome in zip(prompts, outcomes):
        assert outcome["ended"] - cut < END_BOUND, outcome
        if outcome["error"] is None:
            assert outcome["text"] == offline(prompt, MAX_TOKENS)
        else:
            assert "\n" not in outcome["error"].strip(), outcome
    assert on_ctx1 < STREAMS and len(failed) <= on_ctx1, failed
    assert [o["error"] for o in outcomes2] == [None] * SCHED2_STREAMS   # ctx1 not involved
    assert [o["text"] for o in outcomes2] == [offline(p, MAX_TOKENS) for p in prompts2]

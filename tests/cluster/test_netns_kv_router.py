"""The kv_aware router across hosts (issue 29, item 5; network namespaces, :mod:`netns_hosts`):
a scheduler, two context servers and a generation server, each on a host of its own, static
pools, started with the commands a user runs; the context pool routes ``kv_aware`` on the
servers' KV events (``kv_events_port``).

- requests sharing a long prefix go to the context server that prefilled it first (the
  router's decisions say ``overlap``), each with the offline engine's greedy text;
- ``kill -9`` of that server, every process: the requests that follow go to the other
  context server and complete with the same texts (none hangs), and once the dead server's
  events are stale (and its pass-over as a server that did not answer has ended) the
  scheduler says in one line that it no longer trusts them, routing on load (``fallback``).
"""

from __future__ import annotations

import os
import signal

import servers
from netns_hosts import (ROLE_GRPC_PORT, SCHEDULER_GRPC_PORT, grpc_streams, hosts_fixture,
                         metrics_of, serve_role)
from servers import wait_until
from triton_disagg.routing.scrape import total

HOSTS = ("scheduler", "ctx1", "ctx2", "gen1")
ROLE = {"scheduler": "scheduler", "ctx1": "context", "ctx2": "context", "gen1": "generation"}
KV_EVENTS_PORT = 9300
MAX_TOKENS = 8
PREFIX = "Every request of this conversation starts with the same long system prompt. " * 8

hosts = hosts_fixture(HOSTS)


def test_kv_aware_routes_to_the_cache_and_around_a_dead_server(demo_engine, tmp_path, hosts,
                                                                monkeypatch):
    from triton_disagg.kv.secret import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, "netns-kv-router-" + "8" * 32)   # hosts apart share it
    url = {h: f"{hosts.address(h)}:{ROLE_GRPC_PORT}" for h in ("ctx1", "ctx2", "gen1")}
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\n"
                      f"context_server: {{urls: [\"{url['ctx1']}\", \"{url['ctx2']}\"], "
                      f"router: kv_aware, kv_events_port: {KV_EVENTS_PORT}}}\n"
                      f"generation_server: {{urls: [\"{url['gen1']}\"]}}\n"
                      "kv_cache: {strategy: direct_transfer, max_size: 64MB}\n")
    scheduler = f"{hosts.address('scheduler')}:{SCHEDULER_GRPC_PORT}"
    offline = servers.offline_text(demo_engine)

    def routed(host: str) -> float:
        return total(metrics_of(hosts, "scheduler"), "disagg_routed_requests_total",
                     server=url[host])

    def decisions(mode: str) -> float:
        return total(metrics_of(hosts, "scheduler"), "disagg_route_decisions_total",
                     server_role="context", mode=mode)

    def batches_from(host: str) -> float:
        samples = metrics_of(hosts, "scheduler").get("disagg_kv_event_batches_total", {})
        return sum(v for labels, v in samples.items()
                   if ("outcome", "received") in labels
                   and hosts.address(host) in dict(labels).get("publisher", ""))

    def ask(suffixes: list[str]) -> None:
        prompts = [PREFIX + s for s in suffixes]
        assert grpc_streams(hosts, "scheduler", scheduler, MAX_TOKENS, prompts) == \
            [offline(p, MAX_TOKENS) for p in prompts]

    with servers.serve_commands([serve_role(hosts, h, ROLE[h], config, tmp_path / h)
                                 for h in HOSTS]):
        ask(["Who are you?"])
        holder = max(("ctx1", "ctx2"), key=routed)
        other = "ctx2" if holder == "ctx1" else "ctx1"
        seen = batches_from(holder)       # its stored blocks reach the index, then more come
        wait_until(lambda: batches_from(holder) >= seen + 2, 10, "the holder's KV events read")

        before, overlaps = routed(holder), decisions("overlap")
        for suffix in ("What is 2 + 2?", "Tell me a story.", "Bye."):
            ask([suffix])
        assert routed(holder) == before + 3, (routed(holder), before)
        assert decisions("overlap") >= overlaps + 3

        for line in servers.processes_under(tmp_path / holder):     # every process, at once
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        wait_until(lambda: not servers.processes_under(tmp_path / holder), 10,
                   "the holder's processes gone")
        before = routed(other)
        ask(["After the loss, one.", "After the loss, two.", "After the loss, three."])
        assert routed(other) >= before + 3

        # once the dead server's events are stale and its pass-over ends, the router says so
        # in one line and routes on load; requests keep succeeding meanwhile
        said = f"kv_aware router (context): {url[holder]}:"

        def warned() -> bool:
            ask(["Still there?"])
            log = (tmp_path / "scheduler" / "tritonserver.log").read_text(errors="replace")
            return said in log
        wait_until(warned, 30, "the router's line about the dead server's events", poll=1.0)
        assert decisions("fallback") >= 1

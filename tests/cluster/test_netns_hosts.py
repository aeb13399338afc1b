"""Three hosts on one machine (network namespaces, :mod:`netns_hosts`): `serve context`,
`serve generation` and `serve scheduler` each on its own host, bound to that host's
address, with the commands a user runs on real hosts. Tokens travel over tcp on the
scheduler's and generation's host addresses (the config names no scheduler url: its
token socket follows the route to generation, not a url). Concurrent gRPC streams through the scheduler
(the client on the scheduler's host) give the offline engine's greedy text; the KV cache
crosses hosts over UCX TCP (the hosts' UCX may use nothing else, and the context host's
eth0 sent at least the KV bytes generation fetched); both pools return to 0 blocks.
"""

from __future__ import annotations

import contextlib
import time

import servers
from triton_disagg.config import settings as settings_file
from netns_hosts import Hosts, grpc_streams, hosts_fixture, scrape
from triton_disagg.routing.scrape import parse_metrics, total
from triton_disagg.launch.serve_argv import serve_argv

ROLES = ("context", "generation", "scheduler")
GRPC_PORTS = {"context": 9001, "generation": 9002, "scheduler": 8001}
METRICS_PORT = 9100            # the same on every host: each host has its own ports
MAX_TOKENS = 24


hosts = hosts_fixture(ROLES)


def _used(hosts: Hosts, role: str) -> tuple[float, float]:
    """``role``'s (KV blocks used, KV bytes fetched so far) from its metrics."""
    samples = parse_metrics(scrape(hosts, "scheduler",
                           f"http://{hosts.address(role)}:{METRICS_PORT}/metrics"))
    return total(samples, "disagg_kv_blocks_used"), total(samples, "disagg_kv_transfer_bytes_total")


def test_three_roles_on_three_hosts(demo_engine, tmp_path, hosts, monkeypatch):
    from triton_disagg.kv.secret import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, "netns-hosts-" + "7" * 32)   # as hosts apart must share it
    url = {role: f"{hosts.address(role)}:{GRPC_PORTS[role]}" for role in ROLES}
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\n"
                      f"context_server: {{url: \"{url['context']}\", cpus: [0]}}\n"
                      f"generation_server: {{url: \"{url['generation']}\", cpus: [1]}}\n"
                      "kv_cache: {strategy: direct_transfer, max_size: 64MB}\n")
    prompts = servers.PROMPTS * 2
    offline = servers.offline_text(demo_engine)
    with contextlib.ExitStack() as stack:
        for role in ROLES:
            argv = serve_argv(role, str(config), hosts.address(role), GRPC_PORTS[role],
                              METRICS_PORT)
            cmd = [*servers.cli_argv(argv), "--work-dir", str(tmp_path / role)]
            stack.enter_context(servers.serve_command(hosts.command(role, cmd), tmp_path / role,
                                                      None, url[role]))
        for role, model in (("scheduler", "orchestrator"), ("generation", "generation")):
            rendered = settings_file.read(model, tmp_path / role / "model_repository" / model)
            assert rendered.token_host == hosts.address(role), rendered
        sent = hosts.tx_bytes("context")
        texts = grpc_streams(hosts, "scheduler", url["scheduler"], MAX_TOKENS, prompts)
        assert texts == [offline(p, MAX_TOKENS) for p in prompts]
        fetched = _used(hosts, "generation")[1]
        assert hosts.tx_bytes("context") - sent >= fetched > 0      # KV left over the network
        deadline = time.monotonic() + 30
        while any(_used(hosts, role)[0] for role in ("context", "generation")):
            assert time.monotonic() < deadline, "KV pools did not return to 0 blocks"
            time.sleep(0.5)

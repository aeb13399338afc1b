"""The scheduler's pools (routing.pools) from the orchestrator's rendered settings: a static
pool routes over the config's urls; with discovery the routers follow a real etcd (a
server that registers is routed to within 2 s, one that deregisters never again), and
the observer hears each pool's size and whether etcd answers only when one changes."""

from __future__ import annotations

import etcd_server
from servers import wait_until
from triton_disagg.routing.discovery import MemberRecord, Registration
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.config.settings import OrchestratorSettings, PoolSettings
from triton_disagg.routing.pools import start_pools


class Heard:
    def __init__(self):
        self.events: list[tuple] = []

    def members(self, role, count):
        self.events.append(("members", role, count))

    def etcd_reachable(self, reachable):
        self.events.append(("etcd", reachable))


def _settings(engine, urls=None, discovery=None) -> OrchestratorSettings:
    urls = urls or {"context": [], "generation": []}
    return OrchestratorSettings(str(engine), "disaggregated", 30.0, None, "grpc", True, 0,
                                {role: PoolSettings(urls[role], "least_loaded") for role in urls},
                                discovery)


def test_a_static_pool_routes_over_the_config_urls(tmp_path):
    heard = Heard()
    pools = start_pools(_settings(tmp_path, {"context": ["c2:1", "c1:1"], "generation": ["g:1"]}),
                        heard)
    assert [pools.routers["context"].take(1).url for _ in range(3)] == ["c1:1", "c2:1", "c1:1"]
    assert sorted(heard.events) == [("members", "context", 2), ("members", "generation", 1)]
    pools.close()


def test_with_discovery_the_routers_follow_etcd(demo_engine, tmp_path):
    etcd = etcd_server.EtcdServer(tmp_path / "etcd-data").start()
    discovery = etcd.discovery("/pools", 2)
    fingerprint = EngineSpec.load(demo_engine).fingerprint
    heard = Heard()
    pools = start_pools(_settings(demo_engine, discovery={"etcd": discovery.etcd,
                                                          "prefix": "/pools", "ttl_seconds": 2}),
                        heard)
    router = pools.routers["generation"]
    try:
        assert heard.events == [("members", "context", 0), ("members", "generation", 0),
                                ("etcd", True)]
        registration = Registration(discovery, MemberRecord(
            role="generation", grpc_url="gen-01:8001", fingerprint=fingerprint,
            kv_blocks_total=64, tokens_per_block=16)).start()
        wait_until(lambda: router.members(), 2.0, "a server that registers is routed to")
        assert router.take(1).url == "gen-01:8001" and heard.events[-1] == ("members",
                                                                           "generation", 1)
        etcd.kill()                     # the last known set stays, and it is said
        wait_until(lambda: heard.events[-1] == ("etcd", False), 2.0, "etcd unreachable heard")
        assert router.take(1).url == "gen-01:8001"
        etcd.start()
        wait_until(lambda: heard.events[-1] == ("etcd", True), 3.0, "etcd back")
        registration.close()
        wait_until(lambda: not router.members(), 2.0, "a server that left is not routed to")
        assert heard.events.count(("etcd", True)) == 2         # reported on change only
    finally:
        pools.close()
        etcd.stop()

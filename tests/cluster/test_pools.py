"""The scheduler's pools (routing.pools) from the orchestrator's rendered settings: a static
pool routes over the config's urls; with discovery the routers follow a real etcd (a
server that registers is routed to within 2 s, one that deregisters never again), and
the observer hears each pool's size and whether etcd answers only when one changes; a
kv_aware context pool follows the KV event publishers the records name."""

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


def _hasher(token_ids, tokens_per_block, salt):
    """Plain integer names for the test: block i is named by the prefix up to its end."""
    return [hash(tuple(token_ids[:(i + 1) * tokens_per_block])) & (2**64 - 1)
            for i in range(len(token_ids) // tokens_per_block)]


class Decided(Heard):
    def route_decision(self, role, mode):
        self.events.append(("decision", role, mode))

    def kv_event_batches(self, publisher, received, missed):
        self.events.append(("batches", publisher, received, missed))


def test_kv_aware_follows_the_publishers_etcd_names(demo_engine, tmp_path):
    """Records name their KV event publishers; the router subscribes to them, routes to the
    server holding the prompt, falls back when one stops, forgets one that left."""
    import zmq

    from triton_disagg.routing.kv_events import KvEventPublisher

    etcd = etcd_server.EtcdServer(tmp_path / "etcd-data").start()
    discovery = etcd.discovery("/kv", 2)
    fingerprint = EngineSpec.load(demo_engine).fingerprint
    settings = _settings(demo_engine, discovery={"etcd": discovery.etcd, "prefix": "/kv",
                                                 "ttl_seconds": 2})
    settings.pools["context"] = PoolSettings((), "kv_aware")
    heard = Decided()
    context = zmq.Context.instance()
    publishers = {url: KvEventPublisher(context, "127.0.0.1") for url in ("c1:1", "c2:1")}
    registrations = {url: Registration(discovery, MemberRecord(
        role="context", grpc_url=url, fingerprint=fingerprint, kv_blocks_total=64,
        tokens_per_block=4, kv_events=(p.address,))).start() for url, p in publishers.items()}
    pools = start_pools(settings, heard, hasher=_hasher)
    router, feed = pools.routers["context"], pools.feeds["context"]
    prompt = list(range(32))
    try:
        wait_until(lambda: len(router.members()) == 2, 2.0, "both servers registered")
        wait_until(lambda: all(feed.index.fresh(p.address) for p in publishers.values()), 5.0,
                   "both publishers heard (heartbeats)")
        publishers["c2:1"].stored(_hasher(prompt, 4, None), None, prompt, 4)
        wait_until(lambda: feed.index.overlap(publishers["c2:1"].address,
                                              _hasher(prompt, 4, None)) == 8, 2.0, "indexed")
        for _ in range(2):
            assignment = router.take(len(prompt), token_ids=prompt)
            assert assignment.url == "c2:1"
            assignment.release()
        assert [e for e in heard.events if e[0] == "decision"] == [("decision", "context",
                                                                   "overlap")] * 2
        wait_until(lambda: any(e[0] == "batches" and e[2] > 0 for e in heard.events), 2.0,
                   "batch counts reported at a membership poll")
        publishers["c2:1"].close()              # its events stop: fall back, then it leaves
        wait_until(lambda: not feed.index.fresh(publishers["c2:1"].address), 6.0, "stale")
        router.take(len(prompt), token_ids=prompt).release()
        decisions = [e for e in heard.events if e[0] == "decision"]
        assert decisions[-1] == ("decision", "context", "fallback")
        registrations.pop("c2:1").close()
        wait_until(lambda: feed.index.blocks(publishers["c2:1"].address) == 0
                   and len(router.members()) == 1, 3.0, "the server that left is forgotten")
        assert router.take(len(prompt), token_ids=prompt).url == "c1:1"
    finally:
        for registration in registrations.values():
            registration.close()
        pools.close()
        publishers["c1:1"].close()
        etcd.stop()


def test_kv_aware_over_static_urls_follows_kv_events_port(demo_engine):
    """A static pool's publishers are where kv_events_port says: instance i of the j-th
    server of urls publishes on tcp://host:<kv_events_port + 2j + i> (2 instances), each
    instance a member of its own, called by its model."""
    import zmq

    from servers import free_port_run
    from triton_disagg.routing.kv_events import KvEventPublisher

    base = free_port_run(4)
    urls = ["127.0.0.1:1", "127.0.0.2:1"]
    settings = _settings(demo_engine, {"context": urls, "generation": ["g:1"]})
    settings.pools["context"] = PoolSettings(tuple(urls), "kv_aware", None, 4, base, 2)
    context = zmq.Context.instance()
    publishers = [KvEventPublisher(context, host, port=base + 2 * j + i)
                  for j, host in enumerate(("127.0.0.1", "127.0.0.2")) for i in range(2)]
    heard = Decided()
    pools = start_pools(settings, heard, hasher=_hasher)
    router, feed = pools.routers["context"], pools.feeds["context"]
    prompt = list(range(32))
    try:
        assert [m.kv_events for m in router.members()] == [
            (f"tcp://127.0.0.1:{base}",), (f"tcp://127.0.0.1:{base + 1}",),
            (f"tcp://127.0.0.2:{base + 2}",), (f"tcp://127.0.0.2:{base + 3}",)]
        assert {p.address for p in publishers} == {a for m in router.members()
                                                   for a in m.kv_events}
        wait_until(lambda: all(feed.index.fresh(p.address) for p in publishers), 5.0,
                   "every instance heard")
        publishers[3].stored(_hasher(prompt, 4, None), None, prompt, 4)   # 127.0.0.2, #1
        wait_until(lambda: feed.index.blocks(publishers[3].address) == 8, 2.0, "indexed")
        assert [(a.url, a.model) for a in (router.take(32, token_ids=prompt) for _ in range(2))
                ] == [("127.0.0.2:1", "context_1")] * 2
        wait_until(lambda: any(e[0] == "batches" and e[2] > 1 for e in heard.events), 3.0,
                   "batch counts reported on a timer (no membership polls)")
    finally:
        pools.close()
        for publisher in publishers:
            publisher.close()

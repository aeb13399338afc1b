"""The servers the scheduler routes over, per role: the config's urls, or etcd.

:func:`start_pools` reads the orchestrator's rendered settings (:func:`launch.render.settings`:
``pools: {role: {urls, router}}`` and ``discovery``) and returns :class:`Pools`: a
:class:`~triton_disagg.routing.router.Router` per role over

- :class:`StaticMembers`: the role's ``urls`` (no capacity or load is known), or
- :class:`DiscoveredMembers`: with ``discovery``, the role's servers registered in etcd
  (one :class:`~triton_disagg.routing.discovery.Membership` polls for both roles; urls in the
  config are then where those servers bind, not the scheduler's pool).

A context server of several model instances is a member per instance (each its own Triton
model: :func:`~triton_disagg.config.roles.instance_models`): static urls by the role's
``instances``, a discovered server by the models its record names.

A context pool with ``router: kv_aware`` also gets a :class:`~triton_disagg.routing.kv_feed.KvFeed`:
its router scores on the KV events of the publishers its members name: their etcd
records' ``kv_events``, or for static urls ``tcp://<url's host>:<port>`` for each port
:func:`~triton_disagg.routing.kv_events.publisher_ports` gives it (without
``kv_events_port`` a static url names none, so its picks fall back to least_loaded,
logged), with the role's ``tokens_per_block``; block
names are hashed as the engine names them (the role's ``kv_dtype``).

Invariant: the observer (:class:`~triton_disagg.triton.metrics.Metrics`) hears a role's membership size
and etcd's reachability once at the start and again whenever one changes, never more
often (each report is an IPC round trip to Triton); a feed is synced to its role's
members, and its batch counts reported, at every report (every membership poll, or every
``REPORT_SECONDS`` for static pools with a feed).
"""

from __future__ import annotations

from typing import Protocol

from triton_disagg.config.roles import ENGINE_ROLES, Role, instance_models
from triton_disagg.config.settings import OrchestratorSettings
from triton_disagg.routing.discovery import MemberRecord, Membership
from triton_disagg.routing.discovery.periodic import Periodic
from triton_disagg.routing.kv_events import publisher_ports
from triton_disagg.routing.kv_feed import KvEventsObserver, KvFeed, engine_hasher
from triton_disagg.routing.router import (KV_AWARE, Hasher, KvAwareness, Member, RouteObserver,
                                          Router)

REPORT_SECONDS = 1.0         # how often a static pool's KV event counts are reported


class StaticMembers:
    """Each url's members: one per model of its ``instances``
    (:func:`~triton_disagg.config.roles.instance_models`: a context server's instances are
    a member each), each naming the publishers of its own instances. ``tokens_per_block``
    and ``kv_events_port`` are given to a kv_aware pool's members only (module docstring)."""

    def __init__(self, role: str, urls: list[str], tokens_per_block: int | None = None,
                 kv_events_port: int | None = None, instances: int = 1):
        self.role = role
        models = instance_models(Role(role), instances)
        share = instances // len(models)              # model instances per model
        members = []
        for url in sorted(urls):
            host = url.rsplit(":", 1)[0]
            ports = () if kv_events_port is None else tuple(
                publisher_ports(kv_events_port, urls, url, instances))
            members += [Member(url, tokens_per_block, model=_own(role, model), kv_events=tuple(
                f"tcp://{host}:{port}" for port in ports[i * share:(i + 1) * share]))
                for i, model in enumerate(models)]
        self._members = tuple(members)

    def members(self) -> tuple[Member, ...]:
        return self._members

    def where(self) -> str:
        return f"in {self.role}_server.urls"


class DiscoveredMembers:
    def __init__(self, membership: Membership, role: str):
        self.membership, self.role = membership, role

    def members(self) -> tuple[Member, ...]:
        return tuple(m for r in self.membership.members(self.role) for m in _members(r))

    def where(self) -> str:
        discovery = self.membership.discovery
        state = "" if self.membership.etcd_reachable else "; etcd does not answer"
        return (f"registered under {discovery.prefix}/{self.role}/ in etcd at "
                f"{discovery.etcd}{state}")


def _members(record: MemberRecord) -> list[Member]:
    """The record's server as members: one per model it names (each with its own KV event
    publishers and published load, and an even share of the server's capacity: its
    instances' pools are alike), or one for the role's own model (a record naming none)."""
    if not record.models:
        return [Member(record.grpc_url, record.tokens_per_block, record.kv_blocks_total,
                       record.load, record.kv_events)]
    share = record.kv_blocks_total // len(record.models)
    return [Member(record.grpc_url, record.tokens_per_block, share, m.load, m.kv_events,
                   _own(record.role, m.model)) for m in record.models]


def _own(role: str, model: str) -> str | None:
    """``model`` as :attr:`Member.model`: None when it is the role's own."""
    return None if model == role else model


class PoolObserver(RouteObserver, KvEventsObserver, Protocol):
    """What the pools report (:class:`~triton_disagg.triton.metrics.Metrics`)."""

    def members(self, role: str, count: int) -> None: ...

    def etcd_reachable(self, reachable: bool) -> None: ...


class Pools:
    def __init__(self, routers: dict[str, Router], membership: Membership | None,
                 observer: PoolObserver,
                 feeds: dict[str, KvFeed] | None = None):
        self.routers, self.membership, self.observer = routers, membership, observer
        self.feeds = feeds or {}                 # role -> its kv_aware router's feed
        self.reporter: Periodic | None = None    # static pools with feeds: report()'s timer
        self._reported: dict[str, object] = {}

    def report(self, *_: object) -> None:
        """Tell the observer what changed since the last report (the Membership's on_poll)."""
        now: dict[str, object] = {role: len(r.members()) for role, r in self.routers.items()}
        if self.membership is not None:
            now["etcd"] = self.membership.etcd_reachable
        for key, value in now.items():
            if self._reported.get(key) != value:
                self._reported[key] = value
                if key == "etcd":
                    self.observer.etcd_reachable(bool(value))
                else:
                    self.observer.members(key, int(value))
        for role, feed in self.feeds.items():
            feed.sync(self.routers[role].members())
            feed.report(self.observer)

    def close(self) -> None:
        if self.membership is not None:
            self.membership.close()
        if self.reporter is not None:
            self.reporter.stop()
        for feed in self.feeds.values():
            feed.close()


def member_sources(settings: OrchestratorSettings) -> tuple[Membership | None, dict]:
    """Each role's members as the orchestrator's ``settings`` name them: (the Membership,
    not yet started, when they come from etcd, else None; ``{role: source}``)."""
    membership = None
    if settings.discovery is not None:
        from triton_disagg.kv.layout import KV_DTYPES
        from triton_disagg.engine.spec import EngineSpec, KVLayout

        spec = EngineSpec.load(settings.engine)

        def block_nbytes(tokens_per_block: int) -> int:
            """The fewest bytes a block of ``tokens_per_block`` tokens takes (any kv_dtype)."""
            return min(spec.block_geometry(KVLayout(tokens_per_block, dtype)).block_nbytes
                       for dtype in KV_DTYPES)

        membership = Membership(settings.discovery, spec.fingerprint, block_nbytes=block_nbytes)
    return membership, {role: DiscoveredMembers(membership, role) if membership is not None
                        else StaticMembers(role, list(settings.pools[role].urls),
                                           instances=settings.pools[role].instances)
                        for role in ENGINE_ROLES}


def start_pools(settings: OrchestratorSettings, observer: PoolObserver,
                hasher: Hasher | None = None) -> Pools:
    """The routers of ``settings`` (polling etcd from now on when it has discovery);
    ``hasher``: a kv_aware router's block names (default: the engine's)."""
    membership, sources = member_sources(settings)
    routers, feeds = {}, {}
    for role, source in sources.items():
        pool, kv = settings.pools[role], None
        if pool.router == KV_AWARE and role == Role.CONTEXT:     # generation: load (router)
            import zmq

            from triton_disagg.engine.spec import EngineSpec

            spec = EngineSpec.load(settings.engine)
            if isinstance(source, StaticMembers):
                source = StaticMembers(role, list(pool.urls),
                                       pool.tokens_per_block or spec.kv.tokens_per_block,
                                       pool.kv_events_port, pool.instances)
            feeds[role] = KvFeed(zmq.Context.instance())
            kv = KvAwareness(feeds[role].index, hasher or engine_hasher(
                spec.fingerprint, pool.kv_dtype or spec.kv.dtype))
        routers[role] = Router(role, pool.router, source, kv, observer)
    pools = Pools(routers, membership, observer, feeds)
    if membership is None and feeds:         # no polls to report at: a timer of its own
        pools.reporter = Periodic(pools.report, REPORT_SECONDS, "kv-events-report")
        pools.reporter.start()
    elif membership is None:
        pools.report()
    else:
        membership.on_poll = pools.report
        membership.start()
    return pools

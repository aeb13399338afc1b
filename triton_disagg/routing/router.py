"""The scheduler's router: which server of a role takes a request's next call.

One :class:`Router` per role routes over that role's members, read afresh at every
pick from a :class:`MemberSource` (the config's static ``urls``, or the servers
registered in etcd: :mod:`triton_disagg.routing.pools`). A member is a server, or, for a
context server of several model instances, one of its instances: each is a Triton model
of its own (``context``, ``context_1``, ...) that the call names, so every policy below
picks an instance, and "server" below reads "member" (its :attr:`Member.key`). It also
keeps this scheduler's own in-flight accounting per member, in tokens: an
:class:`Assignment` (what :meth:`Router.take` returns) adds a request's tokens to its
member when the request is routed there and takes them off when it is released. What
did not answer is a server (its url): ``tried`` and :meth:`Router.unanswered` leave out
every member of it.

- context: an assignment holds the prompt's tokens from the call until context answers
  (``kv_aware``: those the chosen server would prefill, the prompt less the blocks its
  cache holds, at least one: a cache hit queues little work there, and counting its whole
  prompt would send the next cold prompt behind a real prefill on the other server);
- generation: an assignment holds prompt + max_tokens (the most KV the request can hold
  on the server, rounded up to whole blocks of its ``tokens_per_block`` when known) from
  the call until the request ends.

Policies (``router:`` per role in the config):

- ``round_robin``: the members in url order, one after another.
- ``least_loaded``, context: the fewest queued prompt tokens, ``max(own in flight,
  published queued_prompt_tokens)``. The published figure (when a server reports it)
  counts every scheduler's work as of its last beat, this scheduler's included; the
  own figure is exact now. The max never counts a token twice and never reads less than
  what this scheduler knows is there.
- ``least_loaded``, generation: the most free KV, in tokens, so that servers with other
  ``tokens_per_block`` compare fairly: ``min(kv_blocks_total x tokens_per_block - own
  in flight, free_kv_blocks x tokens_per_block)``. A generation server's free blocks net
  out what its live sequences hold now (all their prompt + max_tokens under
  ``GUARANTEED_NO_EVICT``; under ``MAX_UTILIZATION`` what they have grown to, so the first
  term, which counts each request's most, is the stricter one). With one scheduler the
  first term is exact and the second (about a second old) can be larger; with several,
  the second brings in the others' work
  (taking this scheduler's requests to be among the blocks a server reports used, as for
  context: the used figure is ``max(own, published)``, never the sum).
  Without a capacity (static urls publish none; the config gives every server of a
  static pool the same one) it is ``- own in flight``. Among servers with as much free
  KV, the one with the fewest published ``live_sequences`` wins (every sequence its decode
  loop holds, those still waiting for their blocks included: these are not in its free
  blocks yet, and every live sequence costs a share of each decode step).

- ``kv_aware``, context (TensorRT-LLM's ``kv_cache_aware`` and ``conversation``): the
  lowest cost, Dynamo's KvRouter formula (``overlap_score_weight x potential prefill
  blocks + potential active blocks``, lower wins, temperature 0) with this router's figures::

      cost = OVERLAP_SCORE_WEIGHT x (queued + prompt - overlap x tokens_per_block)
                                    / tokens_per_block
             + (kv_blocks_total - free_kv_blocks)

  ``queued`` is least_loaded's figure (``max(own in flight, published
  queued_prompt_tokens)``), ``overlap`` the leading blocks of the prompt the member holds
  (the best of its model instances' publishers, one for a context instance's member; from
  the KV events index:
  :class:`~triton_disagg.routing.kv_index.KvIndex`; the prompt's chained block hashes
  come from :class:`KvAwareness`'s hasher), the last term its blocks held by live
  requests (0 when it publishes none). Load stays in the cost: a server holding the
  prefix but with far more queued work loses. The decision's mode is counted
  (``observer.route_decision(role, mode)``): ``overlap`` (the server chosen holds some of
  the prompt), ``load`` (it holds none; when no member holds any, the pick is
  least_loaded's, so traffic that shares no prefix is routed exactly as least_loaded
  routes it: the cost's active-blocks term, for a context server the blocks its
  handoffs hold until fetched, is no prefill work), ``fallback``: a pick where some member's
  overlap cannot be trusted (its events stopped or gapped: :meth:`KvIndex.fresh`; it
  publishes none; it does not say its tokens_per_block; the request's token ids did not
  reach the router) is least_loaded's. Each server that turns untrusted is logged once,
  with the reason, and once when it is trusted again: never silently.
- ``kv_aware``, generation: least_loaded (decode is load-bound; each pick counts as
  ``load``).

Ties go round robin: equally loaded servers take turns, so an idle pool spreads
requests the way ``round_robin`` does. "This scheduler" is one orchestrator model
instance: with ``scheduler_server.instances: N`` each instance routes with its own counts.

A server that did not answer (:meth:`Router.unanswered`: refused, unreachable) is passed
over for ``PASS_OVER_SECONDS`` while another member is left: a dead server stays
registered until its lease lapses, and least_loaded would otherwise send every request
there first, its in-flight count being always 0.

Invariants: a pick only ever returns a current member, never one in ``tried``; each
assignment adds its tokens once and takes exactly those off once
(:meth:`Assignment.release` is idempotent), so with nothing in flight
:attr:`Router.in_flight` is empty; everything here runs on one thread (the orchestrator's
event loop), so nothing here locks (the KV index, written by its subscriber's thread,
locks itself).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Protocol, Sequence

from triton_disagg.config.roles import Role
from triton_disagg.routing.discovery.record import Load
from triton_disagg.errors import NoServer
from triton_disagg.routing.kv_index import KvIndex

ROUND_ROBIN, LEAST_LOADED, KV_AWARE = "round_robin", "least_loaded", "kv_aware"
POLICIES = (ROUND_ROBIN, LEAST_LOADED, KV_AWARE)
OVERLAP, LOAD, FALLBACK = "overlap", "load", "fallback"    # a kv_aware decision's mode
PASS_OVER_SECONDS = 5.0
OVERLAP_SCORE_WEIGHT = 1.0       # Dynamo's default: a prefill block weighs one active block
_log = logging.getLogger(__name__)

# (token ids, tokens_per_block, cache_salt) -> the chained hash of each full block
Hasher = Callable[[Sequence[int], int, "str | None"], list[int]]


@dataclass(frozen=True)
class KvAwareness:
    """What a ``kv_aware`` router scores with: the index its KV events feed and the hash
    the servers name their blocks by (the engine's, bound to its fingerprint)."""

    index: KvIndex
    hasher: Hasher


@dataclass(frozen=True)
class Member:
    """What the router may pick: a server, or one model of it that is one model instance
    (a context server of several instances is one member per instance, each its own
    Triton model: :func:`~triton_disagg.config.roles.instance_models`, so the pick is the
    instance whose cache holds the prompt); capacity and load, this member's, are None
    where unknown."""

    url: str                                # "host:port" of its server's gRPC endpoint
    tokens_per_block: int | None = None
    kv_blocks_total: int | None = None
    load: Load = field(default_factory=Load)
    kv_events: tuple[str, ...] = ()        # the KV event publishers of its model instances
    model: str | None = None               # the model to call; None: the role's own

    @property
    def key(self) -> str:
        """What names this member in the router's counts and logs: its url, or
        ``url/model`` for another model of that server."""
        return self.url if self.model is None else f"{self.url}/{self.model}"

    def kv_tokens(self, tokens: int) -> int:
        """The KV ``tokens`` take in this server's pool: whole blocks, when their size is known."""
        if self.tokens_per_block is None:
            return tokens
        return math.ceil(tokens / self.tokens_per_block) * self.tokens_per_block


class MemberSource(Protocol):
    def members(self) -> tuple[Member, ...]:
        """The role's current members, sorted by url."""

    def where(self) -> str:
        """Where the members come from, for messages (e.g. "in generation_server.urls")."""


class RouteObserver(Protocol):
    """Hears each kv_aware decision (:class:`~triton_disagg.triton.metrics.Metrics`)."""

    def route_decision(self, role: str, mode: str) -> None:
        """``mode``: why the server was chosen (module docstring: overlap, load, ...)."""


class Router:
    """``kv`` and ``observer`` serve ``kv_aware``."""

    def __init__(self, role: str, policy: str, source: MemberSource,
                 kv: KvAwareness | None = None, observer: RouteObserver | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}")
        self.role, self.policy, self.source = role, policy, source
        self.kv, self.observer = kv, observer
        self.in_flight: dict[str, int] = {}     # member key -> this scheduler's tokens there (> 0)
        self._passed_over: dict[str, float] = {}   # url -> until when (time.monotonic())
        self._untrusted: dict[str, str] = {}    # kv_aware: member key -> why its overlap is not used
        self._turn = 0

    def members(self) -> tuple[Member, ...]:
        return self.source.members()

    def take(self, tokens: int, tried: Collection[str] = (),
             token_ids: Sequence[int] | None = None, salt: str | None = None) -> "Assignment":
        """Route a request of ``tokens`` to a member whose server is not in ``tried`` (urls);
        NoServer when none is. ``token_ids`` (the prompt) and ``salt`` (its ``cache_salt``)
        serve ``kv_aware``."""
        members = [m for m in self.source.members() if m.url not in tried]
        if not members:
            raise NoServer(self._none_left(tried))
        now = time.monotonic()
        self._passed_over = {url: t for url, t in self._passed_over.items() if t > now}
        members = [m for m in members if m.url not in self._passed_over] or members
        start = self._turn % len(members)
        self._turn += 1
        turn = members[start:] + members[:start]       # ties: the first in turn wins
        cost = tokens
        if self.policy == ROUND_ROBIN:
            chosen = turn[0]
        elif self.policy == KV_AWARE and self.role == Role.CONTEXT:
            chosen, cost = self._kv_pick(turn, tokens, token_ids, salt)
        else:
            chosen = max(turn, key=self._score)
            if self.policy == KV_AWARE:
                self._decided(LOAD)
        if self.role == Role.GENERATION:
            cost = chosen.kv_tokens(tokens)
        self.in_flight[chosen.key] = self.in_flight.get(chosen.key, 0) + cost
        return Assignment(self, chosen, cost)

    def unanswered(self, url: str) -> None:
        """The server at ``url`` failed before it answered: pass it over, every member of
        it, for a while (module docstring)."""
        self._passed_over[url] = time.monotonic() + PASS_OVER_SECONDS

    def _kv_pick(self, turn: list[Member], tokens: int, token_ids: Sequence[int] | None,
                 salt: str | None) -> tuple[Member, int]:
        """The member of least cost (module docstring), or least_loaded's when some
        member's overlap cannot be trusted or none holds any of the prompt; with the
        tokens it would prefill."""
        if not self._trusted(turn, token_ids):
            self._decided(FALLBACK)
            return max(turn, key=self._score), tokens
        assert self.kv is not None and token_ids is not None     # _trusted checked them
        hashes: dict[int, list[int]] = {}       # tokens_per_block -> the prompt's hashes
        overlaps: dict[str, int] = {}           # member key -> the prompt's blocks it holds
        for member in turn:
            tpb = member.tokens_per_block
            assert tpb is not None
            if tpb not in hashes:
                hashes[tpb] = self.kv.hasher(token_ids, tpb, salt)
            overlaps[member.key] = max(self.kv.index.overlap(address, hashes[tpb])
                                       for address in member.kv_events)
        if not any(overlaps.values()):          # nothing to trade against load
            self._decided(LOAD)
            return max(turn, key=self._score), tokens
        chosen = min(turn, key=lambda m: self._cost(m, tokens, overlaps[m.key]))
        self._decided(OVERLAP if overlaps[chosen.key] else LOAD)
        return chosen, _uncached(chosen, tokens, overlaps[chosen.key])

    def _cost(self, member: Member, tokens: int, overlap: int) -> float:
        """Lower is better (module docstring): weighted prefill blocks plus active blocks."""
        tpb = member.tokens_per_block
        assert tpb is not None
        queued = max(self.in_flight.get(member.key, 0), member.load.queued_prompt_tokens or 0)
        uncached = _uncached(member, tokens, overlap)
        active = 0
        if member.kv_blocks_total is not None and member.load.free_kv_blocks is not None:
            active = member.kv_blocks_total - member.load.free_kv_blocks
        return OVERLAP_SCORE_WEIGHT * (queued + uncached) / tpb + active

    def _trusted(self, turn: list[Member], token_ids: Sequence[int] | None) -> bool:
        """Whether every member's overlap can be used now; logs each member whose trust
        changes (once each way)."""
        untrusted = {m.key: why for m in turn if (why := self._distrust(m, token_ids))}
        for key, why in untrusted.items():
            if self._untrusted.get(key) != why:
                _log.warning("kv_aware router (%s): %s: %s; routing least_loaded until it is "
                             "trusted again", self.role, key, why)
        for key in [k for k in self._untrusted if k not in untrusted]:
            if any(m.key == key for m in turn):
                _log.warning("kv_aware router (%s): %s: KV events trusted again; routing on "
                             "KV overlap", self.role, key)
        current = {m.key for m in turn}
        self._untrusted = {u: w for u, w in self._untrusted.items() if u not in current}
        self._untrusted.update(untrusted)
        return not untrusted

    def _distrust(self, member: Member, token_ids: Sequence[int] | None) -> str | None:
        """Why ``member``'s overlap cannot be used now, or None."""
        if token_ids is None:
            return "the request's token ids did not reach the router"
        if self.kv is None:
            return "this router has no KV events index"
        if member.tokens_per_block is None:
            return "its tokens_per_block is unknown"
        if not member.kv_events:
            return "it names no KV events publisher"
        stale = [a for a in member.kv_events if not self.kv.index.fresh(a)]
        if stale:
            return (f"the KV events of {stale[0]} stopped or gapped (none fresh within "
                    f"{self.kv.index.stale_seconds:g} s)")
        return None

    def _decided(self, mode: str) -> None:
        if self.observer is not None:
            self.observer.route_decision(self.role, mode)

    def _score(self, member: Member) -> tuple[int, int]:
        """Higher is less loaded (module docstring): (free KV in tokens or minus the queued
        prompt tokens, minus the live sequences)."""
        own = self.in_flight.get(member.key, 0)
        if self.role == Role.CONTEXT:
            return -max(own, member.load.queued_prompt_tokens or 0), 0
        live = -(member.load.live_sequences or 0)
        if member.kv_blocks_total is None or member.tokens_per_block is None:
            return -own, live
        free = member.kv_blocks_total * member.tokens_per_block - own
        if member.load.free_kv_blocks is not None:
            free = min(free, member.load.free_kv_blocks * member.tokens_per_block)
        return free, live

    def release(self, key: str, cost: int) -> None:
        """An :class:`Assignment`'s ``cost`` tokens leave member ``key``'s in-flight count."""
        left = self.in_flight[key] - cost
        if left:
            self.in_flight[key] = left
        else:
            del self.in_flight[key]

    def _none_left(self, tried: Collection[str]) -> str:
        if tried:
            return f"no other {self.role} server to try ({self.source.where()})"
        return f"no {self.role} server {self.source.where()}"


def _uncached(member: Member, tokens: int, overlap: int) -> int:
    """The tokens of a ``tokens``-token prompt that ``member`` would prefill when its cache
    holds the prompt's first ``overlap`` blocks: at least one (the last token is always
    computed)."""
    assert member.tokens_per_block is not None
    return max(1, tokens - overlap * member.tokens_per_block)


class Assignment:
    """A request routed to ``member``: its ``cost`` in tokens counts in that member's
    :attr:`Router.in_flight` until :meth:`release`. Its call goes to :attr:`url`'s
    :attr:`model` (None: the role's own)."""

    def __init__(self, router: Router, member: Member, cost: int):
        self.router, self.member, self.cost = router, member, cost
        self.released = False

    @property
    def url(self) -> str:
        return self.member.url

    @property
    def model(self) -> str | None:
        return self.member.model

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.router.release(self.member.key, self.cost)

"""The scheduler's router: which server of a role takes a request's next call.

One :class:`Router` per role routes over that role's members, read afresh at every
pick from a :class:`MemberSource` (the config's static ``urls``, or the servers
registered in etcd: :mod:`triton_disagg.routing.pools`). It also keeps this scheduler's
own in-flight accounting per server, in tokens: an :class:`Assignment` (what
:meth:`Router.take` returns) adds a request's tokens to its server when the request is
routed there and takes them off when it is released.

- context: an assignment holds the prompt's tokens from the call until context answers;
- generation: an assignment holds prompt + max_tokens (the KV the server reserves for the
  whole request, rounded up to whole blocks of its ``tokens_per_block`` when known) from
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
  in flight, free_kv_blocks x tokens_per_block)``. A generation server reserves a
  request's whole prompt + max_tokens when it admits it, so free blocks already net out
  every live sequence. With one scheduler the first term is exact and the second (about
  a second old) can only be larger; with several, the second brings in the others' work
  (taking this scheduler's requests to be among the blocks a server reports used, as for
  context: the used figure is ``max(own, published)``, never the sum).
  Without a capacity (static urls publish none; the config gives every server of a
  static pool the same one) it is ``- own in flight``. Among servers with as much free
  KV, the one with the fewest published ``live_sequences`` wins (every sequence its decode
  loop holds, those still waiting for their blocks included: these are not in its free
  blocks yet, and every live sequence costs a share of each decode step).

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
:attr:`Router.in_flight` is empty; everything runs on one thread (the orchestrator's
event loop), so nothing here locks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Collection, Protocol

from triton_disagg.routing.discovery.record import Load
from triton_disagg.errors import NoServer

ROUND_ROBIN, LEAST_LOADED = "round_robin", "least_loaded"
PASS_OVER_SECONDS = 5.0


@dataclass(frozen=True)
class Member:
    """A server the router may pick; capacity and load are None where unknown."""

    url: str                                # "host:port" of its gRPC endpoint
    tokens_per_block: int | None = None
    kv_blocks_total: int | None = None
    load: Load = field(default_factory=Load)

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


class Router:
    def __init__(self, role: str, policy: str, source: MemberSource):
        if policy not in (ROUND_ROBIN, LEAST_LOADED):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.role, self.policy, self.source = role, policy, source
        self.in_flight: dict[str, int] = {}     # url -> this scheduler's tokens there (> 0)
        self._passed_over: dict[str, float] = {}   # url -> until when (time.monotonic())
        self._turn = 0

    def members(self) -> tuple[Member, ...]:
        return self.source.members()

    def take(self, tokens: int, tried: Collection[str] = ()) -> "Assignment":
        """Route a request of ``tokens`` to a member not in ``tried``; NoServer when none is."""
        members = [m for m in self.source.members() if m.url not in tried]
        if not members:
            raise NoServer(self._none_left(tried))
        now = time.monotonic()
        self._passed_over = {url: t for url, t in self._passed_over.items() if t > now}
        members = [m for m in members if m.url not in self._passed_over] or members
        start = self._turn % len(members)
        self._turn += 1
        turn = members[start:] + members[:start]       # ties: the first in turn wins
        chosen = turn[0] if self.policy == ROUND_ROBIN else max(turn, key=self._score)
        cost = chosen.kv_tokens(tokens) if self.role == "generation" else tokens
        self.in_flight[chosen.url] = self.in_flight.get(chosen.url, 0) + cost
        return Assignment(self, chosen.url, cost)

    def unanswered(self, url: str) -> None:
        """``url`` failed before it answered: pass it over for a while (module docstring)."""
        self._passed_over[url] = time.monotonic() + PASS_OVER_SECONDS

    def _score(self, member: Member) -> tuple[int, int]:
        """Higher is less loaded (module docstring): (free KV in tokens or minus the queued
        prompt tokens, minus the live sequences)."""
        own = self.in_flight.get(member.url, 0)
        if self.role == "context":
            return -max(own, member.load.queued_prompt_tokens or 0), 0
        live = -(member.load.live_sequences or 0)
        if member.kv_blocks_total is None or member.tokens_per_block is None:
            return -own, live
        free = member.kv_blocks_total * member.tokens_per_block - own
        if member.load.free_kv_blocks is not None:
            free = min(free, member.load.free_kv_blocks * member.tokens_per_block)
        return free, live

    def _release(self, url: str, cost: int) -> None:
        left = self.in_flight[url] - cost
        if left:
            self.in_flight[url] = left
        else:
            del self.in_flight[url]

    def _none_left(self, tried: Collection[str]) -> str:
        if tried:
            return f"no other {self.role} server to try ({self.source.where()})"
        return f"no {self.role} server {self.source.where()}"


class Assignment:
    """A request routed to the server at ``url``: its ``cost`` in tokens counts in that
    server's :attr:`Router.in_flight` until :meth:`release`."""

    def __init__(self, router: Router, url: str, cost: int):
        self.router, self.url, self.cost = router, url, cost
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.router._release(self.url, self.cost)

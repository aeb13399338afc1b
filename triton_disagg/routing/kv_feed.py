"""A ``kv_aware`` router's KV events: one :class:`~triton_disagg.routing.kv_index.KvIndex`
fed by one :class:`~triton_disagg.routing.kv_events.KvEventSubscriber`, subscribed to the
publishers its role's members name (``Member.kv_events``: from their etcd records).

Invariants: after :meth:`KvFeed.sync`, the subscriber follows exactly the publishers the
members name, and the index has forgotten every publisher no member names any more (a
server that left takes its blocks with it); :meth:`KvFeed.report` hands the observer each
followed publisher's running batch counts (``kv_event_batches``). ``sync`` and ``report``
may run on any thread (the membership's poller calls them).
"""

from __future__ import annotations

from typing import Iterable, Protocol

import zmq

from triton_disagg.routing.kv_events import KvEventSubscriber
from triton_disagg.routing.kv_index import KvIndex
from triton_disagg.routing.router import Hasher, Member


class KvEventsObserver(Protocol):
    """Hears each publisher's running batch counts
    (:class:`~triton_disagg.triton.metrics.Metrics`)."""

    def kv_event_batches(self, publisher: str, received: int, missed: int) -> None: ...


class KvFeed:
    def __init__(self, context: zmq.Context, index: KvIndex | None = None):
        self.index = index if index is not None else KvIndex()
        self._subscriber = KvEventSubscriber(context, self.index)
        self._followed: frozenset[str] = frozenset()

    def sync(self, members: Iterable[Member]) -> None:
        followed = frozenset(a for m in members for a in m.kv_events)
        for address in self._followed - followed:
            self.index.forget(address)
        self._subscriber.set_addresses(set(followed))
        self._followed = followed

    def report(self, observer: KvEventsObserver) -> None:
        """Tell ``observer`` each followed publisher's received and missed batches."""
        for address in sorted(self._followed):
            observer.kv_event_batches(address, *self.index.counts(address))

    def close(self) -> None:
        self._subscriber.close()


def engine_hasher(engine_fingerprint: str, kv_dtype: str) -> Hasher:
    """The block names the engine's prefix cache gives (:mod:`triton_disagg.engine.block_pool`),
    for a server of ``kv_dtype`` and any tokens_per_block."""
    from triton_disagg.engine.block_pool import block_hashes, cache_fingerprint

    fingerprints: dict[int, bytes] = {}      # tokens_per_block -> the cache's fingerprint

    def hashes(token_ids, tokens_per_block: int, salt: str | None) -> list[int]:
        if tokens_per_block not in fingerprints:
            fingerprints[tokens_per_block] = cache_fingerprint(engine_fingerprint,
                                                               tokens_per_block, kv_dtype)
        return block_hashes(token_ids, tokens_per_block, fingerprints[tokens_per_block], salt)
    return hashes

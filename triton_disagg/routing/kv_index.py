"""The scheduler's bounded index of which KV blocks each publisher (a server's model
instance) holds, kept from its KV events (:mod:`triton_disagg.routing.kv_events`).

Per publisher address: the block hashes it reported stored and not since removed, at
most ``max_blocks`` (default ``MAX_BLOCKS_PER_PUBLISHER``: 65,536 hashes, about 6 MB);
past that, the hashes stored longest ago are forgotten first (LRU by store time, as the
server's own pool evicts its least recently used blocks first). A forgotten hash only
makes :meth:`KvIndex.overlap` lower than the truth, never higher.

Health, per publisher: it is *fresh* while a batch (an empty heartbeat counts) arrived
within ``stale_seconds``, and no gap was seen within ``stale_seconds``. A gap, an
undecodable payload or a restart (its sequence started over) forgets what the index
held for it (a view with holes would send requests to a server for blocks it evicted),
so only what it reports from then on counts. :meth:`KvIndex.fresh` is what the router
asks before trusting overlaps (:mod:`triton_disagg.routing.router`).

Invariants: every method is safe from any thread (one lock: the subscriber thread writes,
the router's event loop reads); ``overlap`` counts only leading blocks (a chained hash
names its whole prefix, so the first missing block ends the match); ``received`` and
``missed`` count batches per publisher for the metrics.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Sequence

from triton_disagg.routing.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                             KVEventBatch)

MAX_BLOCKS_PER_PUBLISHER = 1 << 16
STALE_SECONDS = 3.0             # three missed heartbeats (kv_events.HEARTBEAT_SECONDS)


class _Publisher:
    def __init__(self) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()   # oldest stored first
        self.seen = -float("inf")        # time.monotonic() of its last batch
        self.gapped = -float("inf")      # ... of its last gap or restart
        self.received = self.missed = 0  # batches


class KvIndex:
    """Implements :class:`triton_disagg.routing.kv_events.Sink`. ``clock``: seconds, for
    tests (time.monotonic)."""

    def __init__(self, max_blocks: int = MAX_BLOCKS_PER_PUBLISHER,
                 stale_seconds: float = STALE_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        if max_blocks < 1:
            raise ValueError(f"max_blocks {max_blocks} must be at least 1")
        self.max_blocks, self.stale_seconds, self.clock = max_blocks, stale_seconds, clock
        self._publishers: dict[str, _Publisher] = {}
        self._lock = threading.Lock()

    # the subscriber's sink
    def batch(self, address: str, batch: KVEventBatch) -> None:
        with self._lock:
            publisher = self._publisher(address)
            publisher.seen = self.clock()
            publisher.received += 1
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._store(publisher, event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    for block in event.block_hashes:
                        publisher.blocks.pop(block, None)
                elif isinstance(event, AllBlocksCleared):
                    publisher.blocks.clear()

    def gap(self, address: str, missed: int) -> None:
        with self._lock:
            publisher = self._publisher(address)
            publisher.missed += missed
            self._reset(publisher)

    def restarted(self, address: str) -> None:
        with self._lock:
            self._reset(self._publisher(address))

    # the router's side
    def overlap(self, address: str, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (a request's chained block hashes, in order) the
        publisher holds from the first on."""
        with self._lock:
            publisher = self._publishers.get(address)
            if publisher is None:
                return 0
            count = 0
            for block in hashes:
                if block not in publisher.blocks:
                    break
                count += 1
            return count

    def fresh(self, address: str) -> bool:
        """Whether the publisher's events can be trusted now (module docstring)."""
        with self._lock:
            publisher = self._publishers.get(address)
            if publisher is None:
                return False
            now = self.clock()
            return (now - publisher.seen <= self.stale_seconds
                    and now - publisher.gapped > self.stale_seconds)

    def blocks(self, address: str) -> int:
        with self._lock:
            publisher = self._publishers.get(address)
            return 0 if publisher is None else len(publisher.blocks)

    def counts(self, address: str) -> tuple[int, int]:
        """(batches received, batches missed) from the publisher so far."""
        with self._lock:
            publisher = self._publishers.get(address)
            return (0, 0) if publisher is None else (publisher.received, publisher.missed)

    def forget(self, address: str) -> None:
        """Drop everything known of the publisher (it left the pool)."""
        with self._lock:
            self._publishers.pop(address, None)

    def _publisher(self, address: str) -> _Publisher:
        if address not in self._publishers:
            self._publishers[address] = _Publisher()
        return self._publishers[address]

    def _store(self, publisher: _Publisher, hashes: Sequence[int]) -> None:
        blocks = publisher.blocks
        for block in hashes:
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def _reset(self, publisher: _Publisher) -> None:
        publisher.blocks.clear()
        publisher.gapped = self.clock()

"""Sender-side lease table: who still owes a "done" for which KV blocks, until when.

Every handoff grants a lease over the blocks it exposes. The blocks are freed (through
the ``free_blocks`` callback) when the receiver reports it finished reading
(:meth:`LeaseTable.release`) or when the lease's deadline passes (:meth:`LeaseTable.reap`),
whichever comes first. Nothing else frees leased blocks.

Invariant: every granted lease's blocks are passed to ``free_blocks`` exactly once. A
lease leaves the table under the lock before its callback runs, so a release racing a
reap (or a duplicate notification) finds nothing and frees nothing.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional, Sequence


class LeaseExpiredError(RuntimeError):
    """The lease ran out before the receiver fetched the blocks; they may be reused."""


@dataclass(frozen=True)
class Lease:
    lease_id: str
    block_ids: tuple[int, ...]
    deadline: float  # wall clock (time.time())
    filling: bool = False   # its blocks are still being prefilled: no reader can finish yet


class LeaseTable:
    """Thread-safe table of live leases over one pool's blocks.

    ``free_blocks(block_ids)`` returns the blocks to the pool; it is called outside the
    table's lock, so it may take the pool's own lock.
    """

    def __init__(self, free_blocks: Callable[[list[int]], None],
                 clock: Callable[[], float] = time.time):
        self._free_blocks = free_blocks
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._expired_total = 0

    def grant(self, block_ids: Sequence[int], ttl_s: float, filling: bool = False) -> Lease:
        """Lease ``block_ids`` for ``ttl_s`` seconds; the table now owns freeing them."""
        lease = Lease(uuid.uuid4().hex, tuple(int(b) for b in block_ids), self._clock() + ttl_s,
                      filling)
        with self._lock:
            self._leases[lease.lease_id] = lease
        return lease

    def release(self, lease_id: str) -> bool:
        """The receiver is done: free the lease's blocks. False if unknown or already gone."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._free_blocks(list(lease.block_ids))
        return True

    def renew(self, lease_id: str, ttl_s: float, filling: bool) -> bool:
        """Move a live lease's deadline to ``ttl_s`` seconds from now, its blocks still being
        filled or now final (an overlapped transfer's prefill). False if unknown or gone."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                self._leases[lease_id] = Lease(lease_id, lease.block_ids,
                                               self._clock() + ttl_s, filling)
        return lease is not None

    def readable(self) -> int:
        """Leases whose blocks are final, so a reader may be about to finish one."""
        with self._lock:
            return sum(not lease.filling for lease in self._leases.values())

    def reap(self, now: Optional[float] = None) -> int:
        """Free every lease whose deadline is before ``now``; returns how many expired."""
        now = self._clock() if now is None else now
        with self._lock:
            expired = [lease for lease in self._leases.values() if lease.deadline < now]
            for lease in expired:
                del self._leases[lease.lease_id]
            self._expired_total += len(expired)
        errors = []
        for lease in expired:  # free them all even if one callback fails
            try:
                self._free_blocks(list(lease.block_ids))
            except Exception as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
        if errors:
            raise errors[0]
        return len(expired)

    @property
    def expired_total(self) -> int:
        """Leases reclaimed by :meth:`reap` so far (``disagg_kv_leases_expired_total``)."""
        with self._lock:
            return self._expired_total

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

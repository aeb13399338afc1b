"""``strategy: host_memory``: KV handed over through a host shared-memory staging area
(:mod:`triton_disagg.kv.staging`), context and generation on one host.

:class:`HostMemoryConnector` is this strategy's
:class:`~triton_disagg.kv.connector.KVConnector`. On a context instance it owns one area
with one slot per block of its pool, so staging holds whatever the pool can and a handoff
never waits on space only its own batch could free: an export copies the blocks into
slots and frees them at once (a full area raises
:class:`~triton_disagg.kv.staging.StagingFullError` at once: back-pressure, never a wait).
Every instance reads or releases other instances' areas by name through a
:class:`StagingReader`; fetches run on the connector's fetch thread (a local copy, which
numpy does without the GIL, so the decode loop keeps stepping).
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from triton_disagg.kv.connector import ConnectorError, KVConnector, PoolBuffer
from triton_disagg.kv.handle import KVHandle, TransferStats
from triton_disagg.kv.staging import HostStaging, StagingError, StagingFullError

__all__ = ["HostMemoryConnector", "HostStaging", "StagingError", "StagingFullError",
           "StagingReader"]


class StagingReader:
    """Generation side: maps each context's staging area once, by name.

    Invariant: before each fetch, every mapped area that is :meth:`~HostStaging.gone` is
    unmapped, so a stopped or dead context's area is not kept alive by this reader.
    Fetches run one at a time.
    """

    def __init__(self) -> None:
        self._areas: dict[str, HostStaging] = {}
        self._lock = threading.Lock()

    def fetch(self, handle: KVHandle, dst_pool: np.ndarray,
              dst_block_ids: Sequence[int]) -> TransferStats:
        with self._lock:
            return self._area(handle.shm_name).take(handle, dst_pool, dst_block_ids)

    def discard(self, handle: KVHandle) -> None:
        """:meth:`HostStaging.discard` in the handle's area."""
        with self._lock:
            self._area(handle.shm_name).discard(handle)

    def _area(self, name: str) -> HostStaging:
        self._drop_gone()
        if name not in self._areas:
            self._areas[name] = HostStaging.attach(name)
        return self._areas[name]

    def _drop_gone(self) -> None:
        for name, area in list(self._areas.items()):
            if area.gone():
                area.close()
                del self._areas[name]

    def close(self) -> None:
        with self._lock:
            for area in self._areas.values():
                area.close()
            self._areas.clear()


class HostMemoryConnector(KVConnector):
    """``host_memory`` behind the connector interface (module docstring)."""

    strategy = "host_memory"

    def __init__(self, pool: PoolBuffer, name: str, key: bytes, fingerprint: str,
                 lease_seconds: float, free_blocks=None):
        super().__init__(pool, name, key, fingerprint, lease_seconds, free_blocks)
        self.peers = StagingReader()
        self.staging = None if free_blocks is None else HostStaging.create(
            name, len(pool.array), self.geometry.block_nbytes)

    def _export(self, block_ids: list[int], num_tokens: int, prefilling: bool) -> KVHandle:
        try:
            if prefilling:
                raise ConnectorError("host_memory copies the KV out at once: it cannot hand "
                                     "off blocks still being prefilled")
            return self.staging.put(self.pool.array, block_ids, num_tokens, self.fingerprint,
                                    self.lease_seconds)
        finally:
            self.free_blocks(block_ids)

    def handoff_room(self) -> int | None:
        """The staging area's free slots (and a device KV's free staging rows)."""
        free = self.staging.num_slots - self.staging.slots_in_use()
        rows = super().handoff_room()
        return free if rows is None else min(free, rows)

    def _release(self, handle: KVHandle) -> None:
        if self.staging is not None and handle.shm_name == self.staging.name:
            self.staging.discard(handle)
        else:
            self.peers.discard(handle)     # another instance's area on this host

    def expired_total(self) -> int:
        self.staging.reap()
        return self.staging.expired_total

    def _fetch(self, handle: KVHandle, block_ids: list[int], deadline: float) -> TransferStats:
        return self.peers.fetch(handle, self.pool.array, block_ids)   # local: bounded copy

    def _fetch_after(self, handle: KVHandle, skip: int, block_ids: list[int],
                     deadline: float) -> TransferStats:
        """Each slot is freed on its own: after the rest is taken, the slots of the blocks
        left out are marked done too (a discard leaves the taken ones as they are)."""
        stats = super()._fetch_after(handle, skip, block_ids, deadline)
        if skip:
            self._release(handle)
        return stats

    def _close(self) -> None:
        self.peers.close()
        if self.staging is not None:
            self.staging.close()

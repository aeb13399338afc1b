"""The bounded host buffer through which KV computed in device memory is handed off.

A runner that computes its KV in device memory (the torch runner on CUDA) has no host copy
of its pool: the KV connectors move host bytes, so the blocks of a handoff are staged
through a :class:`DeviceStaging` buffer, ``rows`` blocks of the pool's geometry and dtype
(``[rows, L, 2, bs, kvh, hd]``), far fewer than the device pool's blocks: only the blocks
being handed off (exported and not yet fetched, released or expired; or being fetched)
take rows. The connector registers :attr:`DeviceStaging.array` as its pool, and the block
ids its transports see (handles, READs, ``free_blocks``) are row ids.

Invariants: a row is free or holds exactly one device block (the map is one-to-one while
it lasts); a device block has at most one row; a context's row is held by every handoff
whose blocks include its device block (a cached prefix block shared by several live
handoffs shares its row: :meth:`DeviceStaging.hand_off`) and is freed when the last one
ends, each ending giving its own reference to the device block back; every method is
thread-safe (exports run on request threads, fetches on the fetch thread, lease expiry on
a watcher thread).
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from triton_disagg.kv.connector import HandoffBusy
from triton_disagg.kv.layout import BlockGeometry


class DeviceKV(Protocol):
    """KV a runner computes in device memory: block copies to and from rows of a host array
    (:class:`~triton_disagg.engine.torch_model.TorchModelRunner` on CUDA)."""

    def blocks_to_host(self, block_ids: Sequence[int], host: np.ndarray, rows: Sequence[int],
                       layers: Optional[range] = None) -> None:
        """Copy device blocks ``block_ids`` (only ``layers`` of each, if given) into rows
        ``rows`` of ``host``, in its dtype."""

    def blocks_to_device(self, block_ids: Sequence[int], host: np.ndarray,
                         rows: Sequence[int]) -> None:
        """Copy rows ``rows`` of ``host`` into device blocks ``block_ids``."""


class DeviceStaging:
    """``rows`` host blocks between a :class:`DeviceKV` and the KV connectors.

    ``free_device_blocks`` (context): what gives device blocks back to the engine's pool;
    :meth:`freeing` wraps it into the ``free_blocks`` of row ids the transports call.
    """

    def __init__(self, device_kv: DeviceKV, geometry: BlockGeometry, rows: int,
                 free_device_blocks: Optional[Callable[[list[int]], None]] = None):
        self.device_kv, self.geometry = device_kv, geometry
        self.array = np.zeros((rows, *geometry.block_shape), dtype=geometry.dtype)
        self.free_device_blocks = free_device_blocks
        self._lock = threading.Lock()
        self._free = list(range(rows - 1, -1, -1))     # popped from the end: low rows first
        self._device_of: dict[int, int] = {}           # row -> device block
        self._row_of: dict[int, int] = {}              # device block -> row
        self._holders: dict[int, int] = {}             # row -> handoffs holding it (>= 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def reserve(self, device_blocks: Sequence[int], share: bool = False) -> list[int]:
        """A row for each device block (in order); :class:`HandoffBusy`, taking nothing,
        when too few are free now. ``share`` (a context's export): a device block staged
        already (a cached prefix block another live handoff holds) shares its row, which
        then needs no free row; else such a block is a ValueError."""
        blocks = [int(b) for b in device_blocks]
        with self._lock:
            taken = [b for b in blocks if b in self._row_of]
            if taken and not share:
                raise ValueError(f"device KV blocks {taken} are staged already")
            new = len(blocks) - len(taken)
            if new > len(self._free):
                raise HandoffBusy(f"the KV staging buffer has {len(self._free)} of "
                                  f"{len(self.array)} blocks free, {new} needed; "
                                  f"retry later or raise kv_cache.max_size")
            rows = []
            for block in blocks:
                row = self._row_of.get(block)
                if row is None:
                    row = self._free.pop()
                    self._device_of[row], self._row_of[block] = block, row
                self._holders[row] = self._holders.get(row, 0) + 1
                rows.append(row)
        return rows

    def hand_off(self, device_blocks: Sequence[int]) -> list[int]:
        """Context: :meth:`reserve` rows for an export (sharing the rows of blocks other
        live handoffs staged), which owns ``device_blocks`` from this call on: when that
        fails they are given back at once, then the error (:class:`HandoffBusy` when there
        is no room) is raised."""
        try:
            return self.reserve(device_blocks, share=True)
        except Exception:
            self.free_device_blocks([int(b) for b in device_blocks])
            raise

    def release(self, rows: Sequence[int]) -> list[int]:
        """One handoff holding ``rows`` ended: the device block of each (one reference each,
        to give back); a row no other handoff holds is freed (rows not held are skipped)."""
        blocks = []
        with self._lock:
            for row in (int(r) for r in rows):
                block = self._device_of.get(row)
                if block is None:
                    continue
                blocks.append(block)
                self._holders[row] -= 1
                if not self._holders[row]:
                    del self._holders[row], self._device_of[row], self._row_of[block]
                    self._free.append(row)
        return blocks

    def freeing(self) -> Callable[[list[int]], None]:
        """The ``free_blocks`` of row ids a context's transports call: frees the rows and
        gives their device blocks back."""
        def free_rows(rows: list[int]) -> None:
            blocks = self.release(rows)
            if blocks:
                self.free_device_blocks(blocks)
        return free_rows

    def to_host(self, device_blocks: Sequence[int], layers: Optional[range] = None) -> None:
        """Copy reserved device blocks (``layers`` of each, if given) into their rows."""
        blocks = [int(b) for b in device_blocks]
        with self._lock:
            rows = [self._row_of[b] for b in blocks]
        self.device_kv.blocks_to_host(blocks, self.array, rows, layers)

    def to_device(self, rows: Sequence[int]) -> None:
        """Copy reserved rows (a transport just filled them) into their device blocks."""
        rows = [int(r) for r in rows]
        with self._lock:
            blocks = [self._device_of[r] for r in rows]
        self.device_kv.blocks_to_device(blocks, self.array, rows)


def staging_rows(pool_blocks: int, geometry: BlockGeometry, max_bytes: int,
                 longest_blocks: int) -> int:
    """Rows of a staging buffer: ``max_bytes`` (``kv_cache.max_size``) of blocks, at least
    one longest sequence (``longest_blocks``), at most the device pool's blocks."""
    return min(pool_blocks, max(int(max_bytes) // geometry.block_nbytes, longest_blocks))

"""The host_memory strategy's staging area: a bounded, named shared-memory area of KV slots.

The context side creates one area (:meth:`HostStaging.create`) of ``num_slots`` slots of
``slot_bytes`` each; a slot holds one KV block, so a handoff of ``n`` blocks claims any
``n`` free slots (:meth:`HostStaging.put`), and the context frees its pool blocks at once.
The generation side attaches by name from its own process (:meth:`HostStaging.attach`),
claims the slots, copies the blocks into its pool, converting the layout
(:meth:`HostStaging.take`), and marks the slots done.

The area is a file in ``/dev/shm`` named and swept as :mod:`triton_disagg.shm` says: the
creator checks free space first (a full tmpfs would SIGBUS the first large copy), sweeps
dead creators' areas, and unlinks its own on :meth:`HostStaging.close` or, failing that,
when the object is collected or the interpreter exits; a killed creator's area goes at the
next sweep. A reader unmaps an area once its name is gone or its creator died.

Segment layout (all little-endian, native to both processes on one host)::

    uint64[4]      magic, format version, num_slots, slot_bytes
    int64[N]       ticket     slot's current lease; 0 = never used or being rewritten
    int64[N]       done       ticket of the last lease a receiver finished (-ticket: claimed)
    float64[N]     deadline   wall clock (time.time()) after which the slot is reclaimed
    int64[N]       nbytes     bytes of KV in the slot
    (pad to 64)    N * slot_bytes of block data

Invariants: the creator writes ticket/deadline/nbytes and the data; receivers write
only ``done``, and only while holding an exclusive ``flock`` of the area's file (one per
open, so it excludes threads as well as processes), under which a fetch *claims* its
slots (checks they hold its lease, unclaimed and unfetched, and sets ``done`` to
``-ticket``) and a discard frees them: of any number of concurrent fetches of one handle,
exactly one claims it. A slot is busy while ``ticket != 0``, ``ticket != done`` and its
deadline has not passed (a claimed slot stays busy); the slots of one handoff share its
ticket. The creator reuses only slots that are not busy and unpublishes the ticket
before rewriting the data. A receiver copies only after its claim, and checks the
tickets and the deadline (the area's own, on the one host's clock) again after the
copy, so it never returns data from a reclaimed slot.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import threading
import time
import weakref
from typing import Optional, Sequence

import numpy as np

from triton_disagg import shm
from triton_disagg.errors import UserError
from triton_disagg.kv.connector import ConnectorError, HandoffBusy
from triton_disagg.kv.handle import KVHandle, TransferStats
from triton_disagg.kv.layout import BlockGeometry, runs, write_blocks
from triton_disagg.kv.handle import LeaseExpiredError

_MAGIC = 0x3147_5453_564B_4454  # b"TDKVSTG1" little-endian
_VERSION = 1


class StagingError(ConnectorError):
    """The staging area cannot be used (gone, not on this host, or not a staging area)."""


class StagingFullError(StagingError, HandoffBusy):
    """Too few slots are free: the rest hold KV that a generation has not fetched yet and
    whose lease is live."""


class HostStaging:
    """A shared-memory staging area, as its creator (context) or an attacher (generation)."""

    def __init__(self, name: str, fd: int, creator: bool):
        """Map the area open at ``fd``, which this object owns from here (it holds the
        receivers' flock)."""
        self.name, self.path = name, os.path.join(shm.SHM_DIR, name)
        self._fd = fd
        self._close_fd = weakref.finalize(self, os.close, fd)   # by close() or on collection
        self._mapping, self._inode = mmap.mmap(fd, 0), os.fstat(fd).st_ino
        # The creator's unlink, run once: by close(), on collection, or at interpreter exit.
        self._unlink = weakref.finalize(self, _unlink_quietly, self.path) if creator else None
        self._lock = threading.Lock()
        buf = memoryview(self._mapping)
        header = np.frombuffer(buf, np.uint64, 4)
        if int(header[0]) != _MAGIC or int(header[1]) != _VERSION:
            del buf, header
            self.close()
            raise StagingError(f"{self.path} is not a version {_VERSION} KV staging area")
        self.num_slots, self.slot_bytes = int(header[2]), int(header[3])
        n = self.num_slots
        self._ticket = np.frombuffer(buf, np.int64, n, 32)
        self._done = np.frombuffer(buf, np.int64, n, 32 + 8 * n)
        self._deadline = np.frombuffer(buf, np.float64, n, 32 + 16 * n)
        self._nbytes = np.frombuffer(buf, np.int64, n, 32 + 24 * n)
        self._data = np.frombuffer(buf, np.uint8, n * self.slot_bytes, _data_offset(n))
        self._reaped = np.zeros(n, np.int64)  # creator only: last ticket counted as expired
        self.expired_total = 0                # creator only: disagg_kv_leases_expired_total

    @classmethod
    def create(cls, label: str, num_slots: int, slot_bytes: int) -> "HostStaging":
        """Create a new area owned by this process, named after ``label`` (see
        :func:`triton_disagg.shm.new_name`); UserError when ``/dev/shm`` cannot hold it."""
        if num_slots <= 0 or slot_bytes <= 0:
            raise UserError(f"host staging needs slots > 0 and slot bytes > 0, got "
                            f"{num_slots} x {slot_bytes}")
        size = _data_offset(num_slots) + num_slots * slot_bytes
        shm.sweep()
        shm.check_free(size, f"the host_memory KV staging area of {label}")
        name = shm.new_name("kv", label)
        path = os.path.join(shm.SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, np.array([_MAGIC, _VERSION, num_slots, slot_bytes], np.uint64)
                      .tobytes(), 0)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        return cls(name, fd, creator=True)

    @classmethod
    def attach(cls, name: str) -> "HostStaging":
        """Map an existing area by name, without taking ownership (no unlink on close)."""
        if shm.owner_of(name) is None:
            raise StagingError(f"{name!r} does not name a KV staging area")
        try:
            fd = os.open(os.path.join(shm.SHM_DIR, name), os.O_RDWR)
        except FileNotFoundError as exc:
            raise StagingError(
                f"KV staging area {name} not found: the context server stopped, or runs on "
                f"another host (host_memory needs one host; use direct_transfer)") from exc
        return cls(name, fd, creator=False)

    def gone(self) -> bool:
        """True once the area's name was unlinked or its creator died (reader side).

        A dead creator's area is unlinked here, as any sweep may (:mod:`triton_disagg.shm`).
        """
        if shm.orphaned(self.name):
            _unlink_quietly(self.path)
            return True
        try:
            return os.stat(self.path).st_ino != self._inode
        except FileNotFoundError:
            return True

    def _slots_view(self, slots: Sequence[int], geometry: BlockGeometry) -> np.ndarray:
        """The slots' blocks as ``[n, L, 2, bs, kvh, hd]`` (a copy: slots need not be adjacent)."""
        rows = self._data.reshape(self.num_slots, self.slot_bytes)          # [N, slot_bytes]
        raw = rows[np.asarray(slots), :geometry.block_nbytes]               # [n, block_nbytes]
        return raw.view(geometry.dtype).reshape((len(slots),) + geometry.block_shape)

    def _busy(self, now: float) -> np.ndarray:
        live = (self._ticket != 0) & (self._ticket != self._done)
        return live & (self._deadline >= now)

    def put(self, pool: np.ndarray, block_ids: Sequence[int], num_tokens: int,
            fingerprint: str, ttl_s: float) -> KVHandle:
        """Copy ``block_ids`` (token order) of ``pool`` into free slots (creator only).

        The caller frees its pool blocks as soon as this returns. Raises
        :class:`StagingFullError` when too few slots are free now, :class:`UserError`
        when the blocks can never fit.
        """
        if self._unlink is None:
            raise RuntimeError("only the process that created the staging area may put")
        geometry = BlockGeometry.of_pool(pool)
        n = len(block_ids)
        if n != geometry.blocks_for(num_tokens):
            raise ValueError(f"{num_tokens} tokens need {geometry.blocks_for(num_tokens)} "
                             f"blocks, got {n}")
        if geometry.block_nbytes > self.slot_bytes or n > self.num_slots:
            raise UserError(f"{num_tokens} tokens of KV need {n} blocks of "
                            f"{geometry.block_nbytes} bytes; the host staging area has "
                            f"{self.num_slots} slots of {self.slot_bytes}; raise kv_cache.max_size")
        with self._lock:
            now = time.time()
            self._reap(now)
            free = np.flatnonzero(~self._busy(now))
            if free.size < n:
                raise StagingFullError(
                    f"KV staging area {self.name} is full: {free.size} of {self.num_slots} slots "
                    f"are free, {n} needed; the rest wait for a generation fetch or lease expiry; "
                    f"retry later or raise kv_cache.max_size")
            slots, ticket = free[:n], secrets.randbits(62) + 1
            self._ticket[slots] = 0  # unpublish: a late reader of an old lease must not match
            rows = self._data.reshape(self.num_slots, self.slot_bytes)      # [N, slot_bytes]
            blocks = pool[np.asarray(block_ids)].reshape(n, -1).view(np.uint8)  # [n, block_nbytes]
            rows[slots, :geometry.block_nbytes] = blocks
            self._nbytes[slots] = geometry.block_nbytes
            self._deadline[slots] = now + ttl_s
            self._ticket[slots] = ticket  # publish last
        return KVHandle(fingerprint=fingerprint, geometry=geometry, num_tokens=num_tokens,
                        strategy="host_memory", lease_id=f"{ticket:016x}",
                        lease_seconds=ttl_s, shm_name=self.name,
                        slots=tuple(int(x) for x in slots))

    def take(self, handle: KVHandle, dst_pool: np.ndarray,
             dst_block_ids: Sequence[int]) -> TransferStats:
        """Claim the handle's slots, copy them into ``dst_block_ids`` of ``dst_pool``, then
        release them. :class:`LeaseExpiredError` if another fetch claimed them first, or
        they were fetched, discarded or reclaimed."""
        start = time.monotonic()
        src, slots, ticket = handle.geometry, np.asarray(handle.slots), int(handle.lease_id, 16)
        if slots.max() >= self.num_slots or src.block_nbytes > self.slot_bytes:
            raise StagingError(f"handle names slots up to {slots.max()} of {src.block_nbytes} "
                               f"bytes; {self.name} has {self.num_slots} slots of {self.slot_bytes}")

        def check(when: str, done_ok: bool) -> None:
            if (self._ticket[slots] != ticket).any() or not done_ok \
                    or (self._nbytes[slots] != src.block_nbytes).any() \
                    or (self._deadline[slots] < time.time()).any():
                raise LeaseExpiredError(f"KV staging slots of lease {handle.lease_id} were "
                                        f"already fetched or reclaimed ({when})")

        with self._receivers_lock():                  # claim: exactly one fetch gets here
            done = self._done[slots]
            check("before the copy", not ((done == ticket) | (done == -ticket)).any())
            self._done[slots] = -ticket
        if src == BlockGeometry.of_pool(dst_pool):     # one copy per run of slots, from the area
            rows = self._data.reshape(self.num_slots, self.slot_bytes)      # [N, slot_bytes]
            for s, d, k in runs(slots, dst_block_ids):
                dst_pool[d:d + k] = rows[s:s + k, :src.block_nbytes].view(src.dtype).reshape(
                    (k,) + src.block_shape)             # [k, slot_bytes] -> [k, L, 2, bs, kvh, hd]
            check("during the copy", True)
        else:
            staged = self._slots_view(slots, src)               # [n, L, 2, bs, kvh, hd]
            check("during the copy", True)
            write_blocks(staged, handle.num_tokens, dst_pool, dst_block_ids)
        self._done[slots] = ticket
        return TransferStats(nbytes=len(slots) * src.block_nbytes,
                             seconds=time.monotonic() - start)

    def discard(self, handle: KVHandle) -> None:
        """Free the handle's slots without copying them (nobody will fetch it); slots that
        already hold another lease, or were claimed or fetched, are left as they are."""
        slots, ticket = np.asarray(handle.slots), int(handle.lease_id, 16)
        slots = slots[slots < self.num_slots]
        with self._receivers_lock():
            mine = slots[(self._ticket[slots] == ticket) & (self._done[slots] != -ticket)]
            self._done[mine] = ticket

    @contextlib.contextmanager
    def _receivers_lock(self):
        """The exclusive flock under which receivers write ``done`` (module docstring)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def reap(self, now: Optional[float] = None) -> int:
        """Count slots whose lease expired un-fetched (creator only); they are free to reuse."""
        with self._lock:
            return self._reap(time.time() if now is None else now)

    def _reap(self, now: float) -> int:
        """Count each expired lease once (its slots share one ticket)."""
        live = (self._ticket != 0) & (self._ticket != self._done)
        expired = live & (self._deadline < now) & (self._reaped != self._ticket)
        self._reaped[expired] = self._ticket[expired]
        leases = len(np.unique(self._ticket[expired]))
        self.expired_total += leases
        return leases

    def slots_in_use(self, now: Optional[float] = None) -> int:
        return int(self._busy(time.time() if now is None else now).sum())

    def close(self) -> None:
        """Unmap; the creator also unlinks the area. Idempotent."""
        self._ticket = self._done = self._deadline = self._nbytes = self._data = None
        if self._unlink is not None:
            self._unlink()
        mapping, self._mapping = self._mapping, None
        self._close_fd()
        try:
            if mapping is not None:
                mapping.close()
        except BufferError:  # a caller still holds a view; the mapping goes when it does
            pass


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:  # swept already
        pass


def _data_offset(num_slots: int) -> int:
    return -(-(32 + 32 * num_slots) // 64) * 64

"""One KV connector interface for both ends of the handoff, the table of the strategies
that implement it, and the generation instance's one fetch thread.

A :class:`KVConnector` is one model instance's end over its own pool (:class:`PoolBuffer`:
the host array it moves; when the runner computes the KV in device memory, that array is
a bounded :class:`~triton_disagg.kv.device_staging.DeviceStaging` buffer through which
only the blocks being handed off pass, and block ids the transports see are its rows):

- context (made with ``free_blocks``): :meth:`~KVConnector.export` turns prefilled blocks
  into signed handle bytes (``context_phase_params``); from that call on the handoff owns
  the blocks and frees them through ``free_blocks`` exactly once (fetched, released,
  expired, or at once when the export fails), from any thread: the context's loop takes
  them back as messages. :meth:`~KVConnector.handoff_room` says how many blocks an export
  can take now. :meth:`~KVConnector.release` gives back a
  handle nobody will fetch; :meth:`~KVConnector.expired_total` counts leases reclaimed
  unfetched.
- generation: :meth:`~KVConnector.decode` checks a handle (signature first, then engine,
  layout and strategy); :meth:`~KVConnector.start_fetch` starts filling the first blocks of
  a reservation and returns a :class:`Transfer` to :meth:`~Transfer.poll` until done (a
  lock-free look at an Event). The copy runs on the instance's one fetch thread
  (:class:`FetchWorker`), never on the caller's: the decode loop goes on stepping while
  KV arrives.

The fetch thread is one per instance, not one per request: fetches into one pool run one
at a time anyway (they share the NIXL scratch and the staging reader), and a second thread
would only add GIL contention. It runs fetches in submission order, its niceness raised by
``FETCH_NICE`` so that the decode loop's step wins the core they share. A fetch's deadline
(``FETCH_TIMEOUT_SECONDS``, or the handle's lease length if shorter) counts from when it
starts running, not from when it was queued, and the fetch honours it itself (NIXL cancels its
READ, a staging copy is bounded): a fetch queued behind a silent context host's waits for
that one's deadline, then runs, so the silent host fails only its own requests, and the
loop never waits for any of them.

:func:`~triton_disagg.kv.connector_factory.make_connector` chooses the implementation from
:data:`STRATEGIES`, the one map from a strategy's name to its implementation and
properties (``direct_transfer``: :mod:`triton_disagg.kv.nixl`; ``host_memory``:
:mod:`triton_disagg.kv.host_memory`; :mod:`triton_disagg.kv.handle` keys each one's handle
fields by the same names); other code asks :func:`strategy` for a strategy's properties
instead of comparing names.

Invariant (:class:`Transfer`'s): a fetch's destination blocks belong to it until ``poll``
returned stats or raised; ``poll`` reports only what the fetch thread finished, so a
caller freeing blocks after a failed poll never races a copy.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, Sequence

from triton_disagg.errors import UserError
from triton_disagg.kv import handle as kvhandle
from triton_disagg.kv.handle import KVHandle, TransferStats
from triton_disagg.kv.layout import BlockGeometry

if TYPE_CHECKING:
    from triton_disagg.kv.device_staging import DeviceStaging
    from triton_disagg.kv.overlap import Announcer

FreeBlocks = Callable[[list[int]], None]
_log = logging.getLogger(__name__)
# A fetch fails this long after it started running (or at its lease's end, if sooner). Well
# below the default 30 s lease, so KV queued behind a silent context host's fetch is still
# leased when its turn comes; a 2,000-token READ takes ~3 ms here, ~0.6 s on a swamped host.
FETCH_TIMEOUT_SECONDS = 10.0
FETCH_NICE = 5          # added to the fetch thread's niceness (Linux: per thread)

Fetch = Callable[[float], TransferStats]    # blocking; takes its deadline (time.monotonic())


class ConnectorError(RuntimeError):
    """A transport failed: a staging area is gone, NIXL refused or timed out a READ, ..."""


class HandoffBusy(ConnectorError):
    """No room to hand off now; nothing was kept. The context's loop admits a prompt only
    when :meth:`KVConnector.handoff_room` has room for its blocks, so it waits instead."""


@dataclass(frozen=True)
class PoolBuffer:
    """An instance's KV pool as a connector registers it: one C-contiguous host array
    ``[num_blocks, L, 2, bs, kvh, hd]`` (block ``i`` at byte offset
    ``i * geometry.block_nbytes``): the pool's own (the runner computes the KV in it), or
    ``staging``'s rows when the runner computes the KV in device memory."""

    array: Any
    staging: Optional["DeviceStaging"] = None

    @property
    def geometry(self) -> BlockGeometry:
        return BlockGeometry.of_pool(self.array)


class Transfer(ABC):
    """A fetch :meth:`KVConnector.start_fetch` started.

    Invariant: the destination blocks belong to the fetch until :meth:`poll` returned
    stats or raised; only then may the caller use, free or reuse them.
    """

    @abstractmethod
    def poll(self) -> Optional[TransferStats]:
        """None while in flight; the stats once the KV is in place; raises if it failed."""

    def cancel(self) -> None:
        """The request is gone: a transfer still waiting for its sender may end at once
        (failed); one moving bytes ends by its deadline, as it would have."""


class ReleasingTransfer(Transfer):
    """``inner``, calling ``release`` once when :meth:`poll` first reports its end (stats
    or an error): the caller polls until then (:class:`Transfer`'s invariant)."""

    def __init__(self, inner: Transfer, release: Callable[[], Any]):
        self.inner, self._release = inner, release
        self._released = threading.Event()

    def poll(self) -> Optional[TransferStats]:
        try:
            stats = self.inner.poll()
        except BaseException:
            self._release_once()
            raise
        if stats is not None:
            self._release_once()
        return stats

    def cancel(self) -> None:
        self.inner.cancel()

    def _release_once(self) -> None:
        if not self._released.is_set():
            self._released.set()
            self._release()


class ThreadTransfer(Transfer):
    """A transfer that another thread carries out and ends with :meth:`end`; :meth:`poll`
    is a lock-free look at an Event, so it reports only what that thread finished."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._stats: Optional[TransferStats] = None
        self._error: Optional[BaseException] = None

    def poll(self) -> Optional[TransferStats]:
        if not self._done.is_set():
            return None
        if self._error is not None:
            raise self._error
        return self._stats

    def end(self, stats: Optional[TransferStats], error: Optional[BaseException]) -> None:
        """The carrying thread's last word: the stats, or the error ``poll`` raises."""
        self._stats, self._error = stats, error
        self._done.set()


def lower_thread_priority(nice: int, name: str) -> None:
    """Add ``nice`` to the calling thread's niceness (Linux: per thread), so that on a core
    it shares with the decode loop the loop wins; left as it is where that is not allowed."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (OSError, AttributeError):
        _log.debug("KV thread %s keeps its priority", name)


class PendingTransfer(ThreadTransfer):
    """A fetch queued on a :class:`FetchWorker`; ``poll`` returns its stats (``seconds``:
    the copy, ``in_flight_seconds``: submit to done) once the thread finished it."""

    def __init__(self, fetch: Fetch, timeout_s: float):
        super().__init__()
        self.fetch, self.timeout_s = fetch, timeout_s
        self.started = time.monotonic()

    def run(self) -> None:
        """The worker thread's part: run the fetch and record how it ended."""
        try:
            stats = self.fetch(time.monotonic() + self.timeout_s)
        except BaseException as exc:  # noqa: BLE001 - reported to the poller, request fails
            self.end(None, exc)
        else:
            self.end(replace(stats, in_flight_seconds=time.monotonic() - self.started), None)


class FetchWorker:
    """One thread (started on the first submit) running :class:`PendingTransfer` s in
    submission order; ``name`` labels it."""

    def __init__(self, name: str, nice: int = FETCH_NICE):
        self.name, self.nice = name, nice
        self._jobs: queue.SimpleQueue[Optional[PendingTransfer]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def submit(self, fetch: Fetch, timeout_s: float, what: str) -> PendingTransfer:
        """Queue ``fetch``, to run with a deadline ``timeout_s`` after it starts; never
        blocks."""
        job = PendingTransfer(fetch, timeout_s)
        with self._lock:
            if self._closed:
                raise ConnectorError(f"{what}: this KV connector is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self.name}-fetch",
                                                daemon=True)
                self._thread.start()
            self._jobs.put(job)
        return job

    def _run(self) -> None:
        lower_thread_priority(self.nice, self.name)
        while (job := self._jobs.get()) is not None:
            job.run()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop taking fetches; the thread finishes those queued, then ends (idempotent)."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout_s)


@dataclass(frozen=True)
class Strategy:
    """A ``kv_cache.strategy``: its implementation (imported when first made) and the
    properties deployment code needs."""

    name: str
    module: str
    class_name: str
    needs_one_host: bool       # context and generation share one host (and one k8s pod)
    reads_peer_memory: bool    # generation reads the context's pool in place (no staging copy)


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("direct_transfer", "triton_disagg.kv.nixl", "NixlConnector",
             needs_one_host=False, reads_peer_memory=True),
    Strategy("host_memory", "triton_disagg.kv.host_memory", "HostMemoryConnector",
             needs_one_host=True, reads_peer_memory=False),
)}


def strategy(name: str) -> Strategy:
    """The strategy called ``name``; UserError naming the choices if there is none."""
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):
        raise UserError(f"kv_cache.strategy: {name!r} is not one of "
                        f"{', '.join(STRATEGIES)}") from None


class KVConnector(ABC):
    """One instance's end of the KV handoff over ``pool`` (module docstring).

    ``name`` labels its transport resources (agent, staging area); ``key`` signs and checks
    handles; ``fingerprint`` is this engine's; ``lease_seconds`` bounds how long an exported
    handoff waits for its fetch; ``free_blocks`` (context only) returns blocks to the pool
    and must be thread-safe (transports may call it from their own threads).
    """

    strategy: ClassVar[str]

    def __init__(self, pool: PoolBuffer, name: str, key: bytes, fingerprint: str,
                 lease_seconds: float, free_blocks: Optional[FreeBlocks] = None):
        self.pool, self.geometry = pool, pool.geometry
        self.key, self.fingerprint, self.lease_seconds = key, fingerprint, lease_seconds
        self.free_blocks = free_blocks
        self.fetch_timeout_s = FETCH_TIMEOUT_SECONDS
        self.fetcher = FetchWorker(name)

    # ---- context --------------------------------------------------------------------

    def export(self, block_ids: Sequence[int], num_tokens: int,
               prefilling: bool = False) -> bytes:
        """Signed handle bytes for ``block_ids`` (token order, ``num_tokens`` tokens of KV);
        the handoff owns the blocks from this call on, whether it returns or raises
        (:class:`HandoffBusy` when there is no room now, in a transport or the staging
        buffer). ``prefilling`` (an overlapped transfer): the blocks are not prefilled yet;
        the caller restarts the lease as they fill and says when they are final
        (:meth:`renew`) after copying a device KV to the host array itself (:meth:`stage`);
        else that copy is made here."""
        if self.free_blocks is None:
            raise RuntimeError(f"this {self.strategy} connector was made without free_blocks; "
                               f"it cannot export")
        blocks = [int(b) for b in block_ids]
        rows = blocks if self.pool.staging is None else self.pool.staging.hand_off(blocks)
        if not prefilling:
            try:
                self.stage(blocks)
            except BaseException:          # the device copy failed: the KV goes back now
                self.free_blocks(rows)
                raise
        handle = self._export(rows, num_tokens, prefilling)
        try:
            return kvhandle.encode(handle, self.key)
        except kvhandle.HandleError:       # too large to hand out: give the KV back now
            self._release(handle)
            raise

    def handoff_room(self) -> Optional[int]:
        """How many blocks exports can take now without :class:`HandoffBusy` (None: no
        bound): the free rows of a device KV's staging buffer. Only exports take room, and
        one thread exports (the context's loop), so the room it saw lasts until it exports."""
        staging = self.pool.staging
        return None if staging is None else staging.num_free

    def stage(self, block_ids: Sequence[int], layers: Optional[range] = None) -> None:
        """Copy those exported blocks (``layers`` of each, if given) of a device KV to their
        staging rows, which the transport moves (nothing when the KV is computed in the
        array the transport moves)."""
        if self.pool.staging is not None and (layers is None or len(layers)):
            self.pool.staging.to_host(block_ids, layers)

    def release(self, data: bytes) -> None:
        """Give back the KV of handle bytes ``data`` (checked against the deployment key),
        whichever instance on this host made it; a handoff already ended is left alone."""
        self._release(self._ours(kvhandle.decode(data, self.key), "context"))

    @abstractmethod
    def expired_total(self) -> int:
        """Leases reclaimed unfetched so far (``disagg_kv_leases_expired_total``)."""

    # ---- generation -----------------------------------------------------------------

    def decode(self, data: bytes) -> KVHandle:
        """The handle in ``data``, or HandleError when it is unsigned, garbage, from another
        engine or layout, or made for another strategy."""
        handle = kvhandle.decode(data, self.key)
        pool_tokens = len(self.pool.array) * self.geometry.tokens_per_block   # [blocks, ...]
        kvhandle.check_handle(handle, self.fingerprint, self.geometry, pool_tokens)
        return self._ours(handle, "generation")

    def start_fetch(self, handle: KVHandle, block_ids: Sequence[int],
                    cached_blocks: int = 0) -> Transfer:
        """Start filling the first ``blocks_for(handle.num_tokens)`` of ``block_ids`` (a
        sequence's blocks in position order, owned by the caller) with the handle's KV, on
        the fetch thread; returns at once. The fetch fails ``min(fetch_timeout_s,
        handle.lease_seconds)`` after it starts running.

        ``cached_blocks``: the first that many of ``block_ids`` already hold the KV of the
        handle's first blocks (this instance's prefix cache; only when :meth:`can_skip` the
        handle, and never its last block): only the blocks after them are fetched, and the
        handoff ends as a whole (the context frees every block it leased or staged)."""
        blocks = [int(b) for b in block_ids[:self.geometry.blocks_for(handle.num_tokens)]]
        ours = self._ours(handle, "generation")
        if cached_blocks and not (self.can_skip(ours) and cached_blocks < len(blocks)):
            raise ValueError(f"a handle of {len(blocks)} blocks of "
                             f"{ours.geometry.tokens_per_block} tokens cannot skip "
                             f"{cached_blocks} blocks of {self.geometry.tokens_per_block}")

        def fetch(deadline: float) -> TransferStats:
            staging, rest = self.pool.staging, blocks[cached_blocks:]
            if staging is None:
                return self._fetch_after(ours, cached_blocks, rest, deadline)
            rows = staging.reserve(rest)            # one fetch runs at a time per instance
            try:
                stats = self._fetch_after(ours, cached_blocks, rows, deadline)
                staging.to_device(rows)
                return stats
            finally:
                staging.release(rows)

        return self.fetcher.submit(fetch, min(self.fetch_timeout_s, handle.lease_seconds),
                                   f"KV lease {handle.lease_id}")

    def can_skip(self, handle: KVHandle) -> bool:
        """Whether a fetch of ``handle`` may leave out leading blocks this pool holds: its
        blocks start where this pool's do (the same tokens per block)."""
        return handle.geometry.tokens_per_block == self.geometry.tokens_per_block

    def _fetch_after(self, handle: KVHandle, skip: int, block_ids: list[int],
                     deadline: float) -> TransferStats:
        """Move the KV of the handle's blocks after its first ``skip`` (at least one is
        left) into ``block_ids`` and end the whole handoff (fetch thread). Here the fetch of
        the rest ends it (``direct_transfer``: its ticket READ names the lease, which frees
        every block); a strategy that frees a handoff's blocks one by one overrides this."""
        return self._fetch(kvhandle.tail(handle, skip) if skip else handle, block_ids,
                           deadline)

    # ---- --overlap_kv_transfer (strategies that can READ layer ranges as they land) -----

    def listen(self, num_tokens: int) -> tuple[str, bytes]:
        """Generation: expect an overlapped transfer of a ``num_tokens``-token prompt; its
        nonce (for :meth:`start_pull`) and the signed listener for the context
        (:mod:`triton_disagg.kv.overlap`)."""
        raise UserError(f"kv_cache.overlap_transfer needs strategy direct_transfer; "
                        f"{self.strategy} cannot read KV while the context prefills it")

    def start_pull(self, nonce: str, block_ids: Sequence[int],
                   cached_blocks: int = 0) -> Transfer:
        """Generation: READ the listened-for KV into the first of ``block_ids`` as it lands,
        all but the first ``cached_blocks`` (they hold it already, as in :meth:`start_fetch`;
        never the last block)."""
        raise UserError("kv_cache.overlap_transfer needs strategy direct_transfer")

    def staged_pull(self, block_ids: Sequence[int],
                    start: Callable[[list[int]], Transfer]) -> Transfer:
        """``start(ids)`` a pull into ``block_ids``: into themselves, or, for a device KV,
        into staging rows reserved for them (the pull copies them to the device as it ends,
        through ``staging.to_device``) and freed once the transfer has ended."""
        staging = self.pool.staging
        if staging is None:
            return start([int(b) for b in block_ids])
        rows = staging.reserve(block_ids)
        try:
            return ReleasingTransfer(start(rows), lambda: staging.release(rows))
        except BaseException:
            staging.release(rows)
            raise

    def renew(self, data: bytes, prefilling: bool = True) -> None:
        """Context: restart the lease of handle bytes ``data``, its blocks still being filled
        by an overlapped prefill (which may outlast ``lease_seconds``) or, ``prefilling``
        False, final now."""
        raise UserError("kv_cache.overlap_transfer needs strategy direct_transfer")

    def announcer(self, listener: bytes) -> "Announcer":
        """Context: the :class:`~triton_disagg.kv.overlap.Announcer` for generation's signed
        ``listener`` (HandleError if it is not one)."""
        raise UserError(f"kv_cache.overlap_transfer needs strategy direct_transfer; this "
                        f"context serves {self.strategy}")

    def close(self) -> None:
        """Finish the queued fetches (a running one ends by its deadline), then release the
        transport's resources (idempotent)."""
        self.fetcher.close(self.fetch_timeout_s)
        self._close()

    # ---- what an implementation provides ---------------------------------------------

    @abstractmethod
    def _export(self, block_ids: list[int], num_tokens: int, prefilling: bool) -> KVHandle:
        """Hand the blocks to a lease (or copy them out and free them); owns them once called.
        ``prefilling``: see :meth:`export` (a strategy that copies at once cannot)."""

    @abstractmethod
    def _release(self, handle: KVHandle) -> None:
        """End the handoff of ``handle`` without a fetch."""

    @abstractmethod
    def _fetch(self, handle: KVHandle, block_ids: list[int], deadline: float) -> TransferStats:
        """Move the handle's KV into exactly ``block_ids`` (fetch thread); give up by
        ``deadline`` (``time.monotonic()``) and raise."""

    @abstractmethod
    def _close(self) -> None:
        """Release the transport's resources (idempotent; no fetch runs any more)."""

    def _ours(self, handle: KVHandle, role: str) -> KVHandle:
        if handle.strategy != self.strategy:
            raise kvhandle.HandleError(
                f"context_phase_params uses {handle.strategy} but this {role} model is set up "
                f"for {self.strategy}; give both servers the same kv_cache.strategy")
        return handle

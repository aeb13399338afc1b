"""``strategy: direct_transfer``: the receiver READs KV blocks straight from the sender's
pool with NIXL. :class:`NixlEndpoint` carries out the protocol (leases, ticket words,
single-use handles); :class:`NixlConnector` puts it behind the KV connector interface.

One endpoint per process (per model instance), made by its connector and named
``<label>-<pid>-<random>``: one NIXL agent (:class:`~triton_disagg.kv.nixl_agent.Agent`,
UCX: shared memory on one host, TCP/RDMA across hosts); a receiver registers its pool
(READ destinations, never published), a sender keeps one int64 *ticket* word per block of
each lease and registers nothing up front. The connector's fetches run on its fetch
thread; with ``--overlap_kv_transfer`` it also listens for and announces layer-by-layer
transfers (:mod:`triton_disagg.kv.overlap`, :mod:`triton_disagg.kv.layer_reader`), which
run the pieces of a fetch one by one.

- Sender (context): :meth:`NixlEndpoint.export` fills a new array of ticket words, one per
  block of the handle, with a fresh random ticket, registers exactly those blocks' byte
  ranges and that array under the ticket as NIXL device id
  (:meth:`~triton_disagg.kv.nixl_agent.Agent.expose`: a namespace per lease, so no other
  lease's descriptor, live or ended, ever resolves a READ of this one), leases the blocks
  and returns a :class:`KVHandle` naming the agent, the partial metadata of that
  registration alone, the pool and ticket addresses, the block ids and the ticket. A
  watcher thread reads the notifications; ``tdkv-done:<lease id>`` releases the lease, and
  expired leases are reaped on the same thread. Each notification is handled on its own:
  one that names no lease of this endpoint is dropped and counted
  (``NixlEndpoint.dropped``), one whose release fails is logged, and neither keeps the
  others of its pass from their leases; a watcher that dies anyway takes the instance down
  (:mod:`triton_disagg.readers`). Releasing or reaping deregisters the ranges, then zeroes
  the lease's ticket words, *before* the lease's references to its blocks go back to the
  pool. So a handle's holder can name no other block to its NIXL, and none of its own once
  the lease ended (see :mod:`~triton_disagg.kv.nixl_agent` for what the transport below
  NIXL enforces).
- Receiver (generation): :meth:`NixlEndpoint.fetch` loads the handle's metadata into the
  peer's remote agent, READs the blocks (straight into the pool's blocks when the layouts
  match, otherwise into scratch memory followed by :func:`layout.write_blocks`), *then*
  READs the blocks' ticket words (every READ names the handle's ticket as device id),
  naming the lease in that second READ's notification, and accepts the data only if every
  word still holds the handle's ticket. Each READ has one descriptor per run of
  consecutive block ids (usually one: pools hand out ascending ids).

A lease's time is judged by each side on its own clock (``lease_seconds`` is relative):
the sender reaps at export + ``lease_seconds``, the receiver gives up at most
``lease_seconds`` after its fetch began, so clock skew between hosts refuses nothing.

Why this is safe: ticket words read after the data READ finished and still holding the
ticket prove the lease was live at that moment, so it still held a reference to each of
its blocks and none was freed, reused or written while it was being read (tickets are
cleared before the lease's references go, a block is reused only once no reference is
left, and a block the prefix cache shares is full and never written). The notification
rides on the ticket READ, so the handle's own fetch releases the lease only after its
check. A handle is therefore single-use: once its lease is released (or reaped) every
later fetch, from any receiver, sees a cleared or newer ticket and raises
:class:`LeaseExpiredError`; a receiver also refuses a lease id it fetched before, which
closes the window until the sender sees the notification. A replayed handle never
returns another request's KV. A block may be in several live leases at once (a cached
prefix shared by several handoffs): each lease has its own ticket words and holds its
own reference.

Invariants: those of :class:`~triton_disagg.kv.connector.KVConnector`; the sender's blocks
stay untouched until the lease is released or expires; an export that NIXL refuses gives
its blocks back before raising, one it accepts belongs to the lease table from then on;
after a :class:`TransferError` or :class:`LeaseExpiredError` the destination blocks'
contents are undefined. Fetches on one endpoint run one at a time (they share scratch).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import uuid
from typing import Callable, Optional, Sequence

import numpy as np

from triton_disagg.kv import handle as kvhandle
from triton_disagg.kv.connector import KVConnector, PoolBuffer, Transfer
from triton_disagg.kv.handle import KVHandle, LeaseExpiredError, LeaseTable, TransferStats
from triton_disagg.kv.layer_reader import LayerReader
from triton_disagg.kv.layout import BlockGeometry, runs, write_blocks
from triton_disagg.kv.nixl_agent import Agent, TransferError
from triton_disagg.kv.overlap import Announcer
from triton_disagg.kv.overlap_wire import decode_listener
from triton_disagg.readers import MALFORMED, UNKNOWN_REQUEST, DroppedFrames, OnDeath, \
    fail_instance, guarded

NOTIF_PREFIX = b"tdkv-done:"
LEASED_POLL_SECONDS = 0.0005   # watcher pace while a handoff is outstanding (see _watch)
FILLING_POLL_SECONDS = 0.002   # ... while the only ones out are still being prefilled
_TICKET = np.dtype(np.int64)
_log = logging.getLogger(__name__)

__all__ = ["NixlConnector", "NixlEndpoint", "TransferError", "NOTIF_PREFIX"]


class NixlEndpoint:
    """This process's NIXL agent over its KV pool ``[num_blocks, L, 2, bs, kvh, hd]``.

    ``free_blocks`` makes it a sender (an endpoint without it can only fetch): it owns a
    :class:`LeaseTable` (``leases``) whose releases call ``free_blocks`` from the watcher
    thread, which runs :meth:`poll` every ``poll_interval_s``, so ``free_blocks`` must be
    thread-safe. With ``poll_interval_s=None`` no thread starts and the caller polls.
    ``on_death(reader, exc)``: called if the watcher thread ends by an exception.
    """

    def __init__(self, name_prefix: str, pool: np.ndarray,
                 free_blocks: Optional[Callable[[list[int]], None]] = None,
                 poll_interval_s: Optional[float] = 0.01, on_death: OnDeath = fail_instance):
        self.pool = pool
        self.geometry = BlockGeometry.of_pool(pool)
        self._agent = Agent(f"{name_prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                            [pool] if free_blocks is None else [])
        # leased block ids -> (registration, the lease's ticket words [n], token order)
        self._exposed: dict[tuple[int, ...], tuple[object, np.ndarray]] = {}
        self._exposed_lock = threading.Lock()
        self.name = self._agent.name                    # unique across restarts
        self._free_blocks = free_blocks
        self.leases = LeaseTable(self._retire) if free_blocks is not None else None
        self._fetch_lock = threading.Lock()
        self._fetched: dict[str, float] = {}            # lease id -> deadline, until it passes
        self._stop = threading.Event()
        self._wake = threading.Event()                  # set by export: poll at the leased pace
        self._watcher: Optional[threading.Thread] = None
        self.dropped = DroppedFrames("KV lease notifications")
        if self.leases is not None and poll_interval_s is not None:
            watch = guarded("KV lease watcher", lambda: self._watch(poll_interval_s), on_death)
            self._watcher = threading.Thread(target=watch, name=f"{self.name}-notifs",
                                             daemon=True)
            self._watcher.start()

    @property
    def agent(self) -> Agent:
        return self._agent

    # ---- sender ---------------------------------------------------------------------

    def export(self, block_ids: Sequence[int], num_tokens: int, fingerprint: str,
               ttl_s: float, filling: bool = False) -> KVHandle:
        """Lease ``block_ids`` (token order) for ``ttl_s`` s and describe them for a reader;
        ``filling``: they are still being prefilled (:meth:`renew` says when they are final).

        From here the lease table owns the blocks: the caller must not free them. Raises
        ValueError or :class:`TransferError` (NIXL could not register them) before that.
        """
        if self.leases is None:
            raise RuntimeError("this NixlEndpoint was made without free_blocks; it cannot export")
        if len(block_ids) != self.geometry.blocks_for(num_tokens):
            raise ValueError(f"{num_tokens} tokens need {self.geometry.blocks_for(num_tokens)} "
                             f"blocks, got {len(block_ids)}")
        ids, ticket = [int(b) for b in block_ids], secrets.randbits(62) + 1
        with self._exposed_lock:
            if tuple(ids) in self._exposed:
                raise ValueError(f"KV blocks {ids} are already leased as one handoff")
        tickets = np.full(len(ids), ticket, _TICKET)          # [n] this lease's, token order
        size = self.geometry.block_nbytes
        try:
            reg, metadata = self._agent.expose(
                [(self.pool.ctypes.data + s * size, k * size) for s, _, k in runs(ids, ids)]
                + [(tickets.ctypes.data, tickets.nbytes)], ticket)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
            raise TransferError(f"NIXL cannot register {len(ids)} KV blocks: {exc}") from exc
        with self._exposed_lock:
            self._exposed[tuple(ids)] = (reg, tickets)
        lease = self.leases.grant(ids, ttl_s, filling)
        self._wake.set()
        return KVHandle(
            fingerprint=fingerprint, geometry=self.geometry, num_tokens=num_tokens,
            strategy="direct_transfer", lease_id=lease.lease_id, lease_seconds=ttl_s,
            agent_name=self.name, agent_metadata=metadata,
            pool_addr=self.pool.ctypes.data, ticket_addr=tickets.ctypes.data,
            ticket=ticket, block_ids=tuple(ids))

    def release(self, handle: KVHandle) -> None:
        """Give back a lease nobody will fetch (the caller checked the handle's signature):
        this endpoint's own at once, another sender's by the notification its reader would
        have sent. A lease already released or reaped is left as it is."""
        if handle.agent_name == self.name and self.leases is not None:
            self.leases.release(handle.lease_id)
            return
        peer = self._agent.connect(handle.agent_name, handle.agent_metadata)
        self._agent.notify(peer, NOTIF_PREFIX + handle.lease_id.encode())

    def renew(self, lease_id: str, ttl_s: float, filling: bool) -> None:
        """Restart a lease (its blocks still being prefilled, or final now: then the watcher
        goes to the leased pace, a reader is about to finish)."""
        self.leases.renew(lease_id, ttl_s, filling)
        if not filling:
            self._wake.set()

    def _retire(self, block_ids: list[int]) -> None:
        """A lease ended: withdraw its ranges from NIXL, clear its tickets, then give its
        blocks back (LeaseTable callback; the blocks go back even if NIXL fails)."""
        with self._exposed_lock:
            reg, tickets = self._exposed.pop(tuple(block_ids), (None, None))
        try:
            if reg is not None:
                self._agent.withdraw(reg)
        finally:
            if tickets is not None:
                tickets[:] = 0
            self._free_blocks(block_ids)

    def poll(self) -> int:
        """Release the leases named by new notifications and reap expired ones.

        Returns how many leases were released by notification.
        """
        released = sum(self._release_named(msg) for msg in self._agent.notifs())
        self.leases.reap()
        return released

    def _release_named(self, msg: bytes) -> bool:
        """Release the lease that notification ``msg`` names; a notification that names
        none of this endpoint's leases is dropped and counted, a release that fails is
        logged (the pass goes on with the next notification either way)."""
        lease_id = msg[len(NOTIF_PREFIX):] if msg.startswith(NOTIF_PREFIX) else b""
        if not lease_id.isalnum():
            self.dropped.drop(MALFORMED, f"a notification that is no {NOTIF_PREFIX!r} "
                                         f"<lease id>: {msg[:64]!r}")
            return False
        try:
            if self.leases.release(lease_id.decode()):
                return True
        except Exception:  # noqa: BLE001 - the other notifications still release theirs
            _log.exception("KV lease %s: its release failed", lease_id.decode())
            return False
        self.dropped.drop(UNKNOWN_REQUEST, f"a notification for lease {lease_id.decode()}, "
                                           f"which is not out (released or reaped before)")
        return False

    def _watch(self, idle_interval_s: float) -> None:
        """Poll every ``LEASED_POLL_SECONDS`` while a lease whose blocks are final is out,
        every ``FILLING_POLL_SECONDS`` while the only leases out are still being prefilled
        (an overlapped transfer: a reader READs their layers as they land, across hosts
        progressed by these polls, but none can finish yet; polling faster would only take
        the prefill's core and GIL), else every ``idle_interval_s``; an export, or a lease's
        blocks becoming final, wakes it at once. The agent runs without a progress thread,
        so a reader's READ completes only as these polls progress it (UCX's flush after the
        READ waits on this side once a notification went out), and their pace is the
        handoff's latency."""
        interval = idle_interval_s
        while True:
            self._wake.wait(interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - keep watching; the next poll retries
                _log.exception("KV lease watcher of %s", self.name)
            out, readable = len(self.leases), self.leases.readable()
            interval = (LEASED_POLL_SECONDS if readable else FILLING_POLL_SECONDS if out
                        else idle_interval_s)

    # ---- receiver -------------------------------------------------------------------

    def fetch(self, handle: KVHandle, dst_block_ids: Sequence[int],
              timeout_s: float = 30.0) -> TransferStats:
        """READ the handle's blocks into this pool's ``dst_block_ids`` (token order).

        ``dst_block_ids`` must name ``ceil(num_tokens / bs_local)`` blocks. Raises
        :class:`LeaseExpiredError` when the lease ran out or the handle was fetched
        before, :class:`TransferError` when a READ fails or takes longer than ``timeout_s``
        (or than the lease's ``lease_seconds``).
        """
        start = time.monotonic()
        src = handle.geometry
        if not (handle.agent_name and src.same_model(self.geometry)):
            raise ValueError(f"cannot fetch a {handle.strategy} handle of layout {src} "
                             f"into a pool of layout {self.geometry}")
        self._check_blocks(handle, dst_block_ids)
        deadline = start + min(timeout_s, handle.lease_seconds)
        peer = self.open_pull(handle, start)
        n, size = len(handle.block_ids), src.block_nbytes
        words = n * _TICKET.itemsize
        try:
            with self._fetch_lock:
                if src != self.geometry:
                    scratch = self._agent.scratch(words + n * size)
                    staged = scratch[words:words + n * size].view(src.dtype)
                    staged = staged.reshape((n,) + src.block_shape)  # [n, L, 2, bs_src, kvh, hd]
                    self._read(peer, handle, staged.ctypes.data, range(n), None, deadline)
                else:
                    self._read(peer, handle, self.pool.ctypes.data, dst_block_ids, None,
                               deadline)
                self._confirm(peer, handle, deadline)
                if src != self.geometry:
                    write_blocks(staged, handle.num_tokens, self.pool, dst_block_ids)
        finally:
            self._agent.unpin(peer)
        return TransferStats(nbytes=n * size, seconds=time.monotonic() - start)

    # The pieces of a fetch, also run one by one by an overlapped transfer
    # (triton_disagg.kv.layer_reader), which READs each layer range as the context announces it.

    def open_pull(self, handle: KVHandle, now: float) -> str:
        """Claim the handle's lease for this receiver (:meth:`_claim`) and connect to its
        sender, pinned (the caller calls ``agent.unpin(peer)`` once its READs are done);
        returns the peer's name for :meth:`read_layers` and :meth:`confirm`. A connect that
        fails (e.g. the peer's loads at their bound) gives the claim back: nothing was read,
        so the handle may be tried again."""
        self._claim(handle, now)
        try:
            return self._agent.connect(handle.agent_name, handle.agent_metadata, pin=True)
        except Exception:
            with self._fetch_lock:
                self._fetched.pop(handle.lease_id, None)
            raise

    def read_layers(self, peer: str, handle: KVHandle, dst_block_ids: Sequence[int],
                    layers: range, deadline: float) -> int:
        """READ ``layers`` of the handle's blocks straight into the same layers of
        ``dst_block_ids`` (the pools' layouts must be equal); returns the bytes read."""
        if handle.geometry != self.geometry:
            raise ValueError(f"a layer-by-layer READ needs equal KV layouts, got "
                             f"{handle.geometry} into {self.geometry}")
        self._check_blocks(handle, dst_block_ids)
        self._read(peer, handle, self.pool.ctypes.data, dst_block_ids, layers, deadline)
        return len(handle.block_ids) * len(layers) * self.geometry.block_nbytes \
            // self.geometry.num_layers

    def confirm(self, peer: str, handle: KVHandle, deadline: float,
                tickets: np.ndarray) -> None:
        """Check the lease held for every READ so far and end it (:meth:`_confirm`), the
        ticket words READ into ``tickets`` (the caller's, registered with this agent)."""
        self._confirm(peer, handle, deadline, tickets[:len(handle.block_ids)])

    def _check_blocks(self, handle: KVHandle, dst_block_ids: Sequence[int]) -> None:
        if len(dst_block_ids) != self.geometry.blocks_for(handle.num_tokens):
            raise ValueError(f"{handle.num_tokens} tokens need "
                             f"{self.geometry.blocks_for(handle.num_tokens)} local blocks, "
                             f"got {len(dst_block_ids)}")

    def _read(self, peer: str, handle: KVHandle, base: int, dst: Sequence[int],
              layers: Optional[range], deadline: float) -> None:
        """READ the handle's blocks (``layers`` of each; None: whole blocks) to block ``d``
        of ``dst`` at ``base + d * block_nbytes``, source geometry's block size. Whole
        blocks go as one descriptor per run of consecutive ids, layer ranges one per block
        (a block holds its layers one after another: ``[L, 2, bs, kvh, hd]``)."""
        size = handle.geometry.block_nbytes
        if layers is None or len(layers) == handle.geometry.num_layers:
            pairs = [(s, d, k * size) for s, d, k in runs(handle.block_ids, dst)]
            offset = 0
        else:
            step = size // handle.geometry.num_layers
            pairs = [(s, d, len(layers) * step) for s, d in zip(handle.block_ids, dst)]
            offset = layers.start * step
        self._agent.read(peer, [(base + d * size + offset, n, 0) for _, d, n in pairs],
                         [(handle.pool_addr + s * size + offset, n, handle.ticket)
                          for s, _, n in pairs],
                         b"", deadline, f"KV lease {handle.lease_id}")

    def _confirm(self, peer: str, handle: KVHandle, deadline: float,
                 tickets: Optional[np.ndarray] = None) -> None:
        """READ the blocks' ticket words (into ``tickets`` ``[n]``, registered; None: the
        scratch, under ``_fetch_lock``), naming the lease in the READ's notification (the
        sender then ends it), and raise :class:`LeaseExpiredError` unless every word still
        holds the handle's ticket (module docstring: the proof that no block was reused
        during an earlier READ)."""
        n = len(handle.block_ids)
        if tickets is None:
            tickets = self._agent.scratch(n * _TICKET.itemsize)[:n * _TICKET.itemsize]
            tickets = tickets.view(_TICKET)                                     # [n]
        self._agent.read(peer, [(tickets.ctypes.data, 8 * n, 0)],
                         [(handle.ticket_addr, 8 * n, handle.ticket)],
                         NOTIF_PREFIX + handle.lease_id.encode(), deadline,
                         f"KV lease {handle.lease_id} tickets")
        if (tickets != handle.ticket).any():
            raise LeaseExpiredError(f"KV blocks of lease {handle.lease_id} were already "
                                    f"fetched, or the lease expired and the context "
                                    f"reclaimed them; a handle is single-use")

    def _claim(self, handle: KVHandle, now: float) -> None:
        """Mark the lease fetched here (``now``: ``time.monotonic()``); raises
        :class:`LeaseExpiredError` if it was fetched here before. A lease is remembered for
        its ``lease_seconds``: by then the sender reaped it, and its cleared tickets refuse
        it."""
        with self._fetch_lock:
            for lease_id in [k for k, end in self._fetched.items() if end < now]:
                del self._fetched[lease_id]
            if handle.lease_id in self._fetched:
                raise LeaseExpiredError(f"KV blocks of lease {handle.lease_id} were already "
                                        f"fetched; a handle is single-use")
            self._fetched[handle.lease_id] = now + handle.lease_seconds

    def close(self) -> None:
        """Stop the watcher and deregister memory (idempotent). Live leases stay in the table."""
        self._stop.set()
        self._wake.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        self._agent.close()


class NixlConnector(KVConnector):
    """``direct_transfer`` behind the connector interface: exports lease the blocks to a
    NIXL reader; a fetch READs them (see the module docstring)."""

    strategy = "direct_transfer"

    def __init__(self, pool: PoolBuffer, name: str, key: bytes, fingerprint: str,
                 lease_seconds: float, free_blocks=None):
        super().__init__(pool, name, key, fingerprint, lease_seconds, free_blocks)
        self.endpoint = NixlEndpoint(name, pool.array, free_blocks)
        self._layers: Optional[LayerReader] = None

    def listen(self, num_tokens: int) -> tuple[str, bytes]:
        if self._layers is None:
            staging = self.pool.staging
            self._layers = LayerReader(self.endpoint, self.key, self.decode, self.lease_seconds,
                                       staging.to_device if staging is not None else None)
        return self._layers.listen(num_tokens)

    def renew(self, data: bytes, prefilling: bool = True) -> None:
        handle = self._ours(kvhandle.decode(data, self.key), "context")
        self.endpoint.renew(handle.lease_id, self.lease_seconds, prefilling)

    def start_pull(self, nonce: str, block_ids: Sequence[int],
                   cached_blocks: int = 0) -> Transfer:
        return self.staged_pull(block_ids[cached_blocks:],
                                lambda rows: self._layers.start(nonce, rows, cached_blocks))

    def announcer(self, listener: bytes) -> Announcer:
        return Announcer(self.endpoint, decode_listener(listener, self.key))

    def _export(self, block_ids: list[int], num_tokens: int, prefilling: bool) -> KVHandle:
        try:
            return self.endpoint.export(block_ids, num_tokens, self.fingerprint,
                                        self.lease_seconds, filling=prefilling)
        except (ValueError, TransferError):        # refused before the lease took the blocks
            self.free_blocks(block_ids)
            raise

    def _release(self, handle: KVHandle) -> None:
        self.endpoint.release(handle)

    def expired_total(self) -> int:
        return self.endpoint.leases.expired_total

    def _fetch(self, handle: KVHandle, block_ids: list[int], deadline: float) -> TransferStats:
        return self.endpoint.fetch(handle, block_ids, deadline - time.monotonic())

    def _close(self) -> None:
        if self._layers is not None:
            self._layers.close()
        self.endpoint.close()

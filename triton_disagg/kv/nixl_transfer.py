"""``strategy: direct_transfer``: the receiver READs KV blocks from the sender's pool with NIXL.

One :class:`NixlEndpoint` per process (per model instance): one ``nixl_agent`` with the
UCX backend (shared memory on one host, TCP/RDMA across hosts) that registers the whole
pool once.

- Sender (context): :meth:`NixlEndpoint.export` leases the blocks and returns a
  :class:`KVHandle` carrying the agent name, its metadata and the block addresses. A
  watcher thread reads ``get_new_notifs()``; a ``tdkv-done:<lease id>`` notification
  releases the lease, and expired leases are reaped on the same thread.
- Receiver (generation): :meth:`NixlEndpoint.fetch` loads the peer's metadata once per
  peer, READs the blocks (straight into the pool's blocks when the layouts match,
  otherwise into a registered staging buffer followed by :func:`layout.write_blocks`)
  and names the lease id in the READ's notification, which NIXL delivers to the sender
  after the data has been read.

Invariants: the sender's blocks stay untouched until the lease is released or expires;
a fetch either completes before the lease deadline (by the receiver's clock) or raises,
so a fetch never returns data from reclaimed blocks. After a :class:`TransferError`,
the destination blocks' contents are undefined.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid
from typing import Optional, Sequence

import numpy as np

from triton_disagg.errors import UserError
from triton_disagg.kv.handle import KVHandle, TransferStats
from triton_disagg.kv.layout import BlockGeometry, write_blocks
from triton_disagg.kv.leases import LeaseExpiredError, LeaseTable

NOTIF_PREFIX = b"tdkv-done:"
_log = logging.getLogger(__name__)


class TransferError(RuntimeError):
    """A NIXL READ failed or did not finish in time."""


class NixlEndpoint:
    """This process's NIXL agent over its KV pool ``[num_blocks, L, 2, bs, kvh, hd]``.

    ``leases`` makes it a sender (an endpoint without leases can only fetch): a watcher
    thread runs :meth:`poll` every ``poll_interval_s``, so the lease table's
    ``free_blocks`` runs on that thread and must be thread-safe. With
    ``poll_interval_s=None`` no thread starts and the caller runs :meth:`poll` itself.
    """

    def __init__(self, name_prefix: str, pool: np.ndarray, leases: Optional[LeaseTable] = None,
                 poll_interval_s: Optional[float] = 0.01):
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise UserError(f"kv_cache.strategy direct_transfer needs NIXL ({exc}); "
                            f"`pip install nixl`, or use strategy host_memory") from exc
        self.pool = pool
        self.geometry = BlockGeometry.of_pool(pool)
        self.name = f"{name_prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # unique across restarts
        # No progress thread: it spins on its core even when idle (most of a core here).
        # Transfers progress in the reader's check_xfer_state polls, notifications in poll().
        self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False,
                                                              backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise UserError("NIXL has no UCX backend here; reinstall nixl or use host_memory")
        self._pool_reg = self._agent.register_memory(
            [(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
        self._metadata = self._agent.get_agent_metadata()  # after registration: names the pool
        self._agent_lock = threading.Lock()    # serialises every call into the agent
        self._staging_lock = threading.Lock()  # one converting fetch at a time uses the buffer
        self._staging: Optional[np.ndarray] = None
        self._staging_reg = None
        self._peers: dict[str, bytes] = {}     # peer agent name -> digest of its loaded metadata
        self._leases = leases
        self._stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None
        if leases is not None and poll_interval_s is not None:
            self._watcher = threading.Thread(target=self._watch, args=(poll_interval_s,),
                                             name=f"{self.name}-notifs", daemon=True)
            self._watcher.start()

    # ---- sender ---------------------------------------------------------------------

    def export(self, block_ids: Sequence[int], num_tokens: int, fingerprint: str,
               ttl_s: float) -> KVHandle:
        """Lease ``block_ids`` (token order) for ``ttl_s`` s and describe them for a reader.

        From here the lease table owns the blocks: the caller must not free them.
        """
        if self._leases is None:
            raise RuntimeError("this NixlEndpoint was made without a LeaseTable; it cannot export")
        if len(block_ids) != self.geometry.blocks_for(num_tokens):
            raise ValueError(f"{num_tokens} tokens need {self.geometry.blocks_for(num_tokens)} "
                             f"blocks, got {len(block_ids)}")
        base, size = self.pool.ctypes.data, self.geometry.block_nbytes
        lease = self._leases.grant(block_ids, ttl_s)
        return KVHandle(
            fingerprint=fingerprint, geometry=self.geometry, num_tokens=num_tokens,
            strategy="direct_transfer", lease_id=lease.lease_id, lease_deadline=lease.deadline,
            agent_name=self.name, agent_metadata=self._metadata,
            block_addrs=tuple(base + int(b) * size for b in block_ids))

    def poll(self) -> int:
        """Release the leases named by new notifications and reap expired ones.

        Returns how many leases were released by notification.
        """
        with self._agent_lock:
            notifs = self._agent.get_new_notifs()
        released = 0
        for messages in notifs.values():
            for msg in messages:
                if msg.startswith(NOTIF_PREFIX):
                    released += self._leases.release(msg[len(NOTIF_PREFIX):].decode())
        self._leases.reap()
        return released

    def _watch(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - keep watching; the next poll retries
                _log.exception("KV lease watcher of %s", self.name)

    # ---- receiver -------------------------------------------------------------------

    def fetch(self, handle: KVHandle, dst_block_ids: Sequence[int],
              timeout_s: float = 30.0) -> TransferStats:
        """READ the handle's blocks into this pool's ``dst_block_ids`` (token order).

        ``dst_block_ids`` must name ``ceil(num_tokens / bs_local)`` blocks. Raises
        :class:`LeaseExpiredError` when the lease ran out, :class:`TransferError` when the
        READ fails or takes longer than ``timeout_s``.
        """
        start = time.monotonic()
        src = handle.geometry
        if handle.strategy != "direct_transfer" or not src.same_model(self.geometry):
            raise ValueError(f"cannot fetch a {handle.strategy} handle of layout {src} "
                             f"into a pool of layout {self.geometry}")
        if len(dst_block_ids) != self.geometry.blocks_for(handle.num_tokens):
            raise ValueError(f"{handle.num_tokens} tokens need "
                             f"{self.geometry.blocks_for(handle.num_tokens)} local blocks, "
                             f"got {len(dst_block_ids)}")
        remaining = handle.lease_deadline - time.time()
        if remaining <= 0:
            raise LeaseExpiredError(f"KV lease {handle.lease_id} expired {-remaining:.3f} s ago; "
                                    f"the context blocks may have been reclaimed")
        deadline = start + min(timeout_s, remaining)
        peer = self._connect(handle.agent_name, handle.agent_metadata)
        remote = [(addr, src.block_nbytes, 0) for addr in handle.block_addrs]
        notif = NOTIF_PREFIX + handle.lease_id.encode()
        if src == self.geometry:
            base, size = self.pool.ctypes.data, self.geometry.block_nbytes
            local = [(base + int(b) * size, size, 0) for b in dst_block_ids]
            self._read(peer, local, remote, notif, deadline, handle.lease_id)
        else:
            with self._staging_lock:
                staging = self._staging_blocks(src, len(remote))  # [n, L, 2, bs_src, kvh, hd]
                base = staging.ctypes.data
                local = [(base + i * src.block_nbytes, src.block_nbytes, 0)
                         for i in range(len(remote))]
                self._read(peer, local, remote, notif, deadline, handle.lease_id)
                write_blocks(staging, handle.num_tokens, self.pool, dst_block_ids)
        if time.time() > handle.lease_deadline:
            raise LeaseExpiredError(f"KV lease {handle.lease_id} expired during the READ; "
                                    f"the data cannot be trusted")
        return TransferStats(nbytes=len(remote) * src.block_nbytes,
                             seconds=time.monotonic() - start)

    def _connect(self, peer: str, metadata: bytes) -> str:
        """Load a peer's metadata once; reload when the same name comes with new metadata."""
        digest = hashlib.sha256(metadata).digest()
        with self._agent_lock:
            if self._peers.get(peer) != digest:
                if peer in self._peers:
                    self._agent.remove_remote_agent(peer)
                    del self._peers[peer]
                try:
                    loaded = self._agent.add_remote_agent(metadata)
                except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
                    raise TransferError(f"cannot load NIXL metadata of agent {peer}: "
                                        f"{exc}") from exc
                loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
                if loaded != peer:
                    raise TransferError(f"handle names agent {peer!r} but its metadata is "
                                        f"agent {loaded!r}")
                self._peers[peer] = digest
        return peer

    def _staging_blocks(self, src: BlockGeometry, n: int) -> np.ndarray:
        """A registered buffer viewed as ``[n, L, 2, bs_src, kvh, hd]`` in the source dtype."""
        nbytes = n * src.block_nbytes
        if self._staging is None or self._staging.nbytes < nbytes:
            with self._agent_lock:
                if self._staging_reg is not None:
                    self._agent.deregister_memory(self._staging_reg)
                self._staging = np.empty(1 << (nbytes - 1).bit_length(), dtype=np.uint8)
                self._staging_reg = self._agent.register_memory(
                    [(self._staging.ctypes.data, self._staging.nbytes, 0, "")], "DRAM")
        flat = self._staging[:nbytes].view(src.dtype)          # [n * L*2*bs*kvh*hd]
        return flat.reshape((n,) + src.block_shape)              # [n, L, 2, bs_src, kvh, hd]

    def _read(self, peer: str, local: list, remote: list, notif: bytes, deadline: float,
              lease_id: str) -> None:
        with self._agent_lock:
            try:
                xfer = self._agent.initialize_xfer(
                    "READ", self._agent.get_xfer_descs(local, "DRAM"),
                    self._agent.get_xfer_descs(remote, "DRAM"), peer, notif)
            except Exception as exc:  # noqa: BLE001 - e.g. addresses the peer never registered
                raise TransferError(f"NIXL refused the READ of KV lease {lease_id} from "
                                    f"{peer}: {exc}") from exc
            state = self._agent.transfer(xfer)
        pause = 0.0
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(max(pause * 2, 5e-5), 1e-3)
            with self._agent_lock:
                state = self._agent.check_xfer_state(xfer)
        try:
            with self._agent_lock:
                self._agent.release_xfer_handle(xfer)  # cancels a READ still in flight
        except Exception:  # noqa: BLE001 - a handle NIXL could not cancel; it frees it later
            pass
        if state != "DONE":
            what = "did not finish in time" if state == "PROC" else "failed"
            raise TransferError(f"NIXL READ of KV lease {lease_id} from {peer} {what} "
                                f"(state {state})")

    def close(self) -> None:
        """Stop the watcher and deregister memory (idempotent). Live leases stay in the table."""
        if self._pool_reg is None:
            return
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        with self._agent_lock:
            for peer in self._peers:
                self._agent.remove_remote_agent(peer)
            self._peers.clear()
            if self._staging_reg is not None:
                self._agent.deregister_memory(self._staging_reg)
                self._staging_reg = None
            self._agent.deregister_memory(self._pool_reg)
            self._pool_reg = None

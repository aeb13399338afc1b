"""One process's NIXL agent (UCX backend) over registered host memory: the calls the KV
handoff needs (load a peer, READ with an optional notification, new notifications) and a
registered scratch buffer.

Invariants: every call into the agent holds one lock; the metadata is taken after every
fixed region is registered, so it names them all; a peer's metadata is loaded once and
reloaded only when the same name comes with different metadata.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Sequence

import numpy as np

from triton_disagg.errors import UserError
from triton_disagg.kv.connector import ConnectorError


class TransferError(ConnectorError):
    """A NIXL READ failed or did not finish in time."""


class Agent:
    """A ``nixl_agent`` named ``name`` with ``regions`` (contiguous arrays) registered."""

    def __init__(self, name: str, regions: Sequence[np.ndarray]):
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise UserError(f"kv_cache.strategy direct_transfer needs NIXL ({exc}); "
                            f"`pip install nixl`, or use strategy host_memory") from exc
        self.name = name
        # No progress thread: it spins on its core even when idle (most of a core here).
        # Transfers progress in the reader's check_xfer_state polls, notifications in notifs().
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False,
                                                         backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise UserError("NIXL has no UCX backend here; reinstall nixl or use host_memory")
        self._regs = [self._agent.register_memory([(r.ctypes.data, r.nbytes, 0, "")], "DRAM")
                      for r in regions]
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._lock = threading.Lock()
        self._peers: dict[str, bytes] = {}   # peer agent name -> digest of its loaded metadata
        self._scratch = np.empty(0, np.uint8)
        self._scratch_reg = None

    def connect(self, peer: str, metadata: bytes) -> str:
        """Load ``peer``'s metadata (once; again when it changed). Returns the peer name."""
        digest = hashlib.sha256(metadata).digest()
        with self._lock:
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

    def scratch(self, nbytes: int) -> np.ndarray:
        """A registered buffer of at least ``nbytes``; callers serialise its use themselves."""
        if self._scratch.nbytes < nbytes:
            with self._lock:
                if self._scratch_reg is not None:
                    self._agent.deregister_memory(self._scratch_reg)
                self._scratch = np.empty(1 << (nbytes - 1).bit_length(), dtype=np.uint8)
                self._scratch_reg = self._agent.register_memory(
                    [(self._scratch.ctypes.data, self._scratch.nbytes, 0, "")], "DRAM")
        return self._scratch

    def read(self, peer: str, local: list, remote: list, notif: bytes, deadline: float,
             what: str) -> None:
        """READ ``remote`` ``(addr, len, 0)`` ranges of ``peer`` into ``local`` ones; the
        peer gets ``notif`` (if any) after its memory was read. :class:`TransferError`
        unless done by ``deadline`` (``time.monotonic()``)."""
        with self._lock:
            try:
                xfer = self._agent.initialize_xfer(
                    "READ", self._agent.get_xfer_descs(local, "DRAM"),
                    self._agent.get_xfer_descs(remote, "DRAM"), peer, notif)
            except Exception as exc:  # noqa: BLE001 - e.g. addresses the peer never registered
                raise TransferError(f"NIXL refused the READ of {what} from {peer}: "
                                    f"{exc}") from exc
            state = self._agent.transfer(xfer)
        pause = 0.0     # then 50 us doubling to 250 us: the sender's watcher polls every 0.5 ms
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(max(pause * 2, 5e-5), 2.5e-4)
            with self._lock:
                state = self._agent.check_xfer_state(xfer)
        try:
            with self._lock:
                self._agent.release_xfer_handle(xfer)  # cancels a READ still in flight
        except Exception:  # noqa: BLE001 - a handle NIXL could not cancel; it frees it later
            pass
        if state != "DONE":
            result = "did not finish in time" if state == "PROC" else "failed"
            raise TransferError(f"NIXL READ of {what} from {peer} {result} (state {state})")

    def notify(self, peer: str, message: bytes) -> None:
        """Send ``peer`` (connected) a notification on its own, not bound to a READ."""
        with self._lock:
            try:
                self._agent.send_notif(peer, message)
            except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
                raise TransferError(f"cannot notify NIXL agent {peer}: {exc}") from exc

    def notifs(self) -> list[bytes]:
        """Notification messages received since the last call, from every peer."""
        with self._lock:
            notifs = self._agent.get_new_notifs()
        return [msg for messages in notifs.values() for msg in messages]

    def close(self) -> None:
        """Forget peers and deregister memory (idempotent)."""
        with self._lock:
            for peer in self._peers:
                self._agent.remove_remote_agent(peer)
            self._peers.clear()
            for reg in self._regs + ([self._scratch_reg] if self._scratch_reg else []):
                self._agent.deregister_memory(reg)
            self._regs, self._scratch_reg = [], None

"""One process's NIXL agent (UCX backend) over registered host memory: the calls the KV
handoff needs (expose byte ranges to a peer, load a peer, READ with an optional
notification, new notifications) and a registered scratch buffer.

Invariants: every call into the agent holds one lock. A peer is given only the metadata
of one :meth:`Agent.expose` (connection info and the remote keys of those ranges) or
:meth:`Agent.contact` (connection info alone), nothing else (no fixed region is ever
published); :meth:`Agent.withdraw` deregisters them. Remote agents are bounded
(:class:`RemoteAgents`): at most ``MAX_PEERS``, none idle longer than ``PEER_IDLE_S``,
none holding more than ``MAX_LOADS`` handles' descriptors, none after a failed READ; a
remote agent pinned by a fetch in progress (:meth:`Agent.connect` with ``pin``, until
:meth:`Agent.unpin`) is never removed under it: those bounds wait for its last unpin. So
that fetches which overlap without end cannot hold that reload off for ever (every handle
adds descriptors, see below), a remote agent at ``2 * MAX_LOADS`` loads takes no new pin
(:class:`TransferError`) until its fetches in progress end and it is loaded afresh.

Each :meth:`Agent.expose` registers its ranges under a device id of its own (the
caller's: a lease's ticket), and a READ names the ranges with that id. NIXL orders a remote
agent's descriptors by device id, then address, and looks a READ's range up in the one that
starts last at or before it with the same device id: so a READ is resolved against the
descriptors of its own exposure alone, and another's (an ended lease's, still loaded: NIXL
cannot unload a part of a remote agent) can neither hide a live range nor stand in for it.
Without it, a lease's tail (a range starting inside its descriptor) was refused whenever an
ended lease's descriptor started in between (``NIXL_ERR_NOT_FOUND``), and two live leases
over the same cached blocks registered equal descriptors, which NIXL finds by value: a
handle could carry the other lease's remote key, and a withdrawal deregister the other's.

What NIXL enforces and what it does not: NIXL registers memory with no read-only mode,
so a holder may READ or WRITE the ranges it was given (its own blocks and ticket words:
it can spoil only its own handoff); its NIXL refuses a READ or WRITE anywhere else
(``NIXL_ERR_NOT_FOUND``). A receiver's NIXL keeps the descriptors of every handle it
loaded until the peer is reloaded or forgotten, so to it an ended lease's blocks stay
nameable under that lease's device id. Below NIXL, an RDMA NIC enforces the registration
(and its withdrawal), but within one host UCX copies with ``process_vm_readv``/``writev``
(CMA) and across hosts over TCP with software RMA, neither of which checks the remote key:
a peer that patches its NIXL/UCX can still read or write any address of the sender
process. The lease tickets, not the registration, are what keep an honest reader from ever
returning reused blocks.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, OrderedDict
from typing import Any, Callable, Sequence
# Any here: NIXL's agent and registration objects, which have no types.

import numpy as np

from triton_disagg.errors import UserError
from triton_disagg.log_format import adopt_logger
from triton_disagg.kv.connector import ConnectorError


SHARED_MEMORY_TLS = frozenset({"self", "sm", "shm", "posix", "sysv", "cma", "knem", "xpmem",
                               "cuda_copy", "cuda_ipc"})      # one host's, no sockets
MAX_PEERS = 32          # remote agents kept loaded; the least recently used goes first
PEER_IDLE_S = 300.0     # a remote agent unused this long is removed (a restarted context)
MAX_LOADS = 4096        # handles' descriptors loaded into one remote agent before a reload



def error_handling_mode(ucx_tls: str | None) -> str:
    """NIXL's UCX endpoint error handling for UCX's transports ``ucx_tls``: ``peer``
    (NIXL's default: a dead peer fails the transfers to it), unless every transport is one
    of one host's shared memory, which has no peer failure handler (UCX refuses such an
    endpoint): ``none``, as ``serve all`` runs (its peers are stubs of one tritonserver,
    which serve restarts whole when one dies: :func:`launch.deploy.ucx_env`)."""
    if not ucx_tls or ucx_tls.startswith("^"):        # UCX's defaults, or all but some
        return "peer"
    names = {t.strip() for t in ucx_tls.split(",") if t.strip()}
    return "none" if names <= SHARED_MEMORY_TLS else "peer"

class TransferError(ConnectorError):
    """A NIXL READ failed or did not finish in time."""


class RemoteAgents:
    """The remote agents loaded into ``agent`` (a ``nixl_agent``), bounded as the module
    says. Each handle's metadata is loaded as it comes (NIXL merges a known agent's new
    descriptors, at no new connection); a remote agent whose loads reach ``max_loads`` is
    removed and loaded afresh, so that the descriptors of handles long done do not pile
    up. A pinned agent (:meth:`pin`, once per fetch that uses it) is neither evicted,
    expired nor reloaded; one forgotten while pinned goes at its last :meth:`unpin`, and
    the table may hold more than ``max_peers`` while pins keep it so. A pinned agent's
    loads stay under ``2 * max_loads``: at that many, a load is refused until its last
    unpin (the next load then reloads it). Callers hold the agent's lock."""

    def __init__(self, agent: Any, max_peers: int = MAX_PEERS, idle_s: float = PEER_IDLE_S,
                 max_loads: int = MAX_LOADS, clock: Callable[[], float] = time.monotonic):
        self._agent, self._clock = agent, clock
        self.max_peers, self.idle_s, self.max_loads = max_peers, idle_s, max_loads
        self._peers: OrderedDict[str, list] = OrderedDict()  # name -> [last use, loads]
        self._pins: Counter[str] = Counter()                 # name -> fetches using it
        self._doomed: set[str] = set()                       # forgotten while pinned

    def load(self, peer: str, metadata: bytes, pin: bool = False) -> None:
        """Load ``metadata`` of agent ``peer`` (and :meth:`pin` it); TransferError if it
        names another agent, or if ``peer`` is pinned with ``2 * max_loads`` loads."""
        now = self._clock()
        for name in [n for n, (used, _) in self._peers.items()
                     if now - used > self.idle_s and n not in self._pins]:
            self.forget(name)
        loads = self._peers[peer][1] if peer in self._peers else 0
        if loads >= self.max_loads and peer not in self._pins:
            self.forget(peer)
        elif loads >= 2 * self.max_loads:
            raise TransferError(f"NIXL agent {peer} holds the descriptors of {loads} handles "
                                f"and {self._pins[peer]} fetches still read from it: no new "
                                f"one until they end and it is loaded afresh; retry")
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
            raise TransferError(f"cannot load NIXL metadata of agent {peer}: {exc}") from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != peer:
            if loaded not in self._peers:
                self._agent.remove_remote_agent(loaded)
            raise TransferError(f"handle names agent {peer!r} but its metadata is "
                                f"agent {loaded!r}")
        loads = self._peers.pop(peer, [now, 0])[1]
        self._peers[peer] = [now, loads + 1]                # most recently used last
        self._doomed.discard(peer)                          # loaded afresh: wanted again
        if pin:
            self.pin(peer)
        self._evict()

    def pin(self, peer: str) -> None:
        """Keep ``peer`` loaded until as many :meth:`unpin` calls (a fetch reads from it)."""
        self._pins[peer] += 1

    def unpin(self, peer: str) -> None:
        """One fetch is done with ``peer``; at the last, what waited for it happens."""
        if self._pins[peer] > 1:
            self._pins[peer] -= 1
            return
        self._pins.pop(peer, None)
        if peer in self._doomed:
            self.forget(peer)
        self._evict()

    def forget(self, peer: str) -> None:
        """Remove ``peer`` (e.g. after a failed READ) now, or at its last unpin if it is
        pinned; a peer not loaded is left alone."""
        if peer in self._pins:
            self._doomed.add(peer)
        elif self._peers.pop(peer, None) is not None:
            self._doomed.discard(peer)
            self._agent.remove_remote_agent(peer)

    def clear(self) -> None:
        """Remove every peer, pinned or not (the agent is closing)."""
        self._pins.clear()
        for peer in list(self._peers):
            self.forget(peer)

    def _evict(self) -> None:
        """Remove the least recently used unpinned peers beyond ``max_peers``."""
        unpinned = [n for n in self._peers if n not in self._pins]
        for name in unpinned[:max(0, len(self._peers) - self.max_peers)]:
            self.forget(name)

    def __len__(self) -> int:
        return len(self._peers)


class Agent:
    """A ``nixl_agent`` named ``name`` with ``regions`` (contiguous arrays) registered for
    its own READs' destinations; no peer is ever given their descriptors."""

    def __init__(self, name: str, regions: Sequence[np.ndarray]):
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise UserError(f"kv_cache.strategy direct_transfer needs NIXL ({exc}); "
                            f"`pip install nixl`, or use strategy host_memory") from exc
        adopt_logger("nixl")      # NIXL writes its own plain lines; json mode: ours
        self.name = name
        # No progress thread: NIXL's Python API gives it a 0 ms poll timeout, so it spins
        # (94% of a core idle); with 10 ms (0.5%) the stall bench was no better
        # (docs/benchmarks.md, stall notes).
        # Transfers progress in the reader's check_xfer_state polls, notifications in notifs().
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False,
                                                         backends=[]))
        if "UCX" not in self._agent.plugin_list:
            raise UserError("NIXL has no UCX backend here; reinstall nixl or use host_memory")
        self._agent.create_backend("UCX", {"ucx_error_handling_mode":
                                           error_handling_mode(os.environ.get("UCX_TLS"))})
        self._regs = [self._agent.register_memory([(r.ctypes.data, r.nbytes, 0, "")], "DRAM")
                      for r in regions]
        self._lock = threading.Lock()
        self._exposed: list = []             # registrations expose() made, not withdrawn
        self._remotes = RemoteAgents(self._agent)
        self._scratch = np.empty(0, np.uint8)
        self._scratch_reg = None

    @property
    def exposed(self) -> int:
        """Registrations :meth:`expose` made and :meth:`withdraw` has not undone."""
        return len(self._exposed)

    @property
    def registered(self) -> int:
        """This agent's own READ destinations registered (:meth:`register` and the
        ``regions`` it was made with), the scratch buffer not counted."""
        return len(self._regs)

    def expose(self, ranges: Sequence[tuple[int, int]], dev_id: int) -> tuple[Any, bytes]:
        """Register ``ranges`` ``(addr, nbytes)`` of this process under device id ``dev_id``
        (in ``[1, 2**63)``, unique among this agent's exposures: a peer's READs name it, see
        the module docstring); returns the registration (for :meth:`withdraw`) and the
        metadata a peer needs to READ exactly those ranges: connection info plus their
        remote keys, nothing else."""
        with self._lock:
            reg = self._agent.register_memory([(a, n, dev_id, "") for a, n in ranges],
                                              "DRAM")
            try:
                metadata = self._agent.get_partial_agent_metadata(reg, True, ["UCX"])
            except Exception:
                self._agent.deregister_memory(reg)
                raise
            self._exposed.append(reg)
        return reg, metadata

    def register(self, array: np.ndarray) -> Any:
        """Register ``array`` (contiguous) as a destination of this agent's own READs; never
        exposed to a peer. Returns the registration for :meth:`unregister`."""
        with self._lock:
            reg = self._agent.register_memory([(array.ctypes.data, array.nbytes, 0, "")], "DRAM")
            self._regs.append(reg)
        return reg

    def unregister(self, reg: Any) -> None:
        """Deregister what :meth:`register` returned (a closed agent has done it already)."""
        with self._lock:
            if reg in self._regs:
                self._regs.remove(reg)
                self._agent.deregister_memory(reg)

    def withdraw(self, reg: Any) -> None:
        """Deregister what :meth:`expose` returned as ``reg`` (once)."""
        with self._lock:
            self._exposed.remove(reg)
            self._agent.deregister_memory(reg)

    def contact(self) -> bytes:
        """Connection info alone, no memory's keys: what a peer needs to send this agent
        notifications (and nothing more)."""
        from nixl._api import nixlBind

        with self._lock:
            return self._agent.get_partial_agent_metadata(
                nixlBind.nixlRegDList(self._agent.nixl_mems["DRAM"], []), True, ["UCX"])

    def connect(self, peer: str, metadata: bytes, pin: bool = False) -> str:
        """Load ``peer``'s (partial) metadata (see :class:`RemoteAgents`); ``pin``: keep it
        loaded until :meth:`unpin` (a fetch's READs from it). Returns its name."""
        with self._lock:
            self._remotes.load(peer, metadata, pin)
        return peer

    def unpin(self, peer: str) -> None:
        """Undo one :meth:`connect` with ``pin``."""
        with self._lock:
            self._remotes.unpin(peer)

    def forget(self, peer: str) -> None:
        """Remove ``peer``'s loaded metadata (after a failed READ: it may have restarted)."""
        with self._lock:
            self._remotes.forget(peer)

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
        """READ ``remote`` ``(addr, len, dev_id)`` ranges of ``peer`` (``dev_id``: the one
        the peer's :meth:`expose` of them used) into ``local`` ``(addr, len, 0)`` ones; the
        peer gets ``notif`` (if any) after its memory was read. :class:`TransferError`
        unless done by ``deadline`` (``time.monotonic()``); a failed READ also forgets the
        peer, whose next handle loads it afresh."""
        with self._lock:
            try:
                xfer = self._agent.initialize_xfer(
                    "READ", self._agent.get_xfer_descs(local, "DRAM"),
                    self._agent.get_xfer_descs(remote, "DRAM"), peer, notif)
            except Exception as exc:  # noqa: BLE001 - e.g. addresses the peer never exposed
                self._remotes.forget(peer)
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
            self.forget(peer)
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
        return [msg for messages in self.notifs_by_peer().values() for msg in messages]

    def notifs_by_peer(self) -> dict[str, list[bytes]]:
        """Notification messages received since the last call, by the sending agent's name."""
        with self._lock:
            notifs = self._agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else k): v for k, v in notifs.items()}

    def close(self) -> None:
        """Forget peers and deregister memory, exposed ranges included (idempotent)."""
        with self._lock:
            self._remotes.clear()
            for reg in self._regs + self._exposed + ([self._scratch_reg] if self._scratch_reg
                                                     else []):
                self._agent.deregister_memory(reg)
            self._regs, self._exposed, self._scratch_reg = [], [], None

"""Generation's side of ``--overlap_kv_transfer`` (:mod:`triton_disagg.kv.overlap` states
the protocol and its trust): :class:`LayerReader` files the context's notifications for each
listened request, READs each newly final layer range straight into the sequence's blocks,
then the ticket words (the lease check of :mod:`~triton_disagg.kv.nixl`, which
ends the lease), and reports the transfer done with the first token.

Invariants: the :class:`~triton_disagg.kv.connector.Transfer` one (the sequence's blocks
belong to the transfer until ``poll`` returned or raised; only the reader's thread
writes them, and it reports only what it finished); every pull ends (done, failed, its
context's FAILED, cancelled, or its deadline: ``lease_seconds`` after it began waiting,
again from when the sequence got its blocks if no handle came before (the context is only
called then), then ``handle.lease_seconds`` after the handle or the context's latest
progress came; the
context restarts the handle's lease at each layer too), and then its nonce is forgotten;
each notification is handled on its own: one that is not of this protocol or names no
pull is dropped and counted (``LayerReader.dropped``), one whose handling fails fails
its pull alone, and a reader thread that dies anyway takes the instance down
(:mod:`triton_disagg.readers`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from triton_disagg.kv import handle as kvhandle, overlap_wire as wire
from triton_disagg.kv.connector import (ConnectorError, ThreadTransfer, Transfer,
                                        lower_thread_priority)
from triton_disagg.kv.handle import KVHandle, TransferStats
from triton_disagg.readers import MALFORMED, UNKNOWN_REQUEST, DroppedFrames, OnDeath, \
    fail_instance, guarded

if TYPE_CHECKING:
    from triton_disagg.kv.nixl import NixlEndpoint

POLL_SECONDS = 0.001        # the reader's pace while a pull waits for notifications
MAX_PULLS = 4096            # listeners outstanding per instance; beyond that: refused
READER_NICE = 5             # like the fetch thread: the decode loop's step wins its core
PEER_IDLE_SECONDS = 60.0    # a context agent's reader thread ends after this long idle
_log = logging.getLogger(__name__)


class PulledTransfer(ThreadTransfer):
    """An overlapped transfer as the scheduler polls it; the reader thread ends it."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


@dataclasses.dataclass
class _Pull:
    """One request's overlapped transfer on the generation side (reader thread only)."""

    num_tokens: int
    deadline: float
    began: float                                # listened (monotonic)
    started: float = 0.0                        # the sequence had its blocks
    blocks: Optional[list[int]] = None          # the sequence's blocks, once it has them
    skip: int = 0                               # leading blocks generation's cache holds
    transfer: Optional[PulledTransfer] = None
    handle: Optional[KVHandle] = None
    peer: str = ""
    announced: int = 0                          # layers the context says are final
    read: int = 0                               # layers read so far
    nbytes: int = 0
    copy_seconds: float = 0.0                   # in this pull's READs (and device copy)
    first: Optional[tuple[int, float]] = None
    failure: Optional[str] = None
    busy: bool = False                          # its context's reader is on it (READs)
    backlog: list = dataclasses.field(default_factory=list)  # handles that came while busy


class LayerReader:
    """Generation's reader of overlapped transfers over ``endpoint``'s pool. One dispatcher
    thread (started by the first :meth:`listen`) files the notifications and ends the pulls
    that were cancelled, failed or ran out of time; the READs of the pulls whose KV comes
    from one context agent run on that agent's own thread (:class:`_PeerReader`), so a
    context host that stops answering mid-READ holds up only its own requests.
    ``check(data)`` decodes and checks a handle (the connector's ``decode``);
    ``staged(blocks)`` copies landed blocks to the device (None on a host pool);
    ``lease_seconds`` bounds the wait for the handle; ``on_death(reader, exc)`` is called
    if a reader thread ends by an exception."""

    def __init__(self, endpoint: "NixlEndpoint", key: bytes,
                 check: Callable[[bytes], KVHandle], lease_seconds: float,
                 staged: Optional[Callable[[Sequence[int]], None]] = None,
                 on_death: OnDeath = fail_instance):
        self.endpoint, self.key, self.check = endpoint, key, check
        self.lease_seconds, self.staged, self.on_death = lease_seconds, staged, on_death
        self.dropped = DroppedFrames("overlapped KV notifications")
        self._contact = endpoint.agent.contact()
        self._pulls: dict[str, _Pull] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._peers: dict[str, _PeerReader] = {}        # context agent -> its reader

    def listen(self, num_tokens: int) -> tuple[str, bytes]:
        """Expect the KV of a ``num_tokens``-token prompt: the pull's nonce and the signed
        listener to hand to the context. ConnectorError when too many are outstanding."""
        listener = wire.Listener.new(self.endpoint.name, self._contact)
        now = time.monotonic()
        with self._lock:
            if len(self._pulls) >= MAX_PULLS:
                raise ConnectorError(f"{MAX_PULLS} overlapped KV transfers are outstanding on "
                                     f"this instance; retry later")
            self._pulls[listener.nonce] = _Pull(num_tokens, now + self.lease_seconds, now)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=guarded("overlapped KV dispatcher", self._run, self.on_death),
                    daemon=True, name=f"{self.endpoint.name}-layers")
                self._thread.start()
        self._wake.set()
        return listener.nonce, wire.encode_listener(listener, self.key)

    def start(self, nonce: str, block_ids: Sequence[int], skip: int = 0) -> Transfer:
        """The sequence holds its blocks: READ into the first of ``block_ids`` as layers are
        announced, the handle's blocks after its first ``skip`` (generation's prefix cache
        holds those; ``block_ids`` start after them). A pull that has ended already is a
        failed transfer."""
        transfer = PulledTransfer()
        with self._lock:
            pull = self._pulls.get(nonce)
            if pull is None or pull.transfer is not None:
                transfer.end(None, ConnectorError("overlapped KV transfer: the wait for the "
                                                  "context ended before the sequence had "
                                                  "blocks (its deadline passed)"))
                return transfer
            pull.blocks = list(block_ids[:self.endpoint.geometry.blocks_for(pull.num_tokens)
                                         - skip])
            pull.transfer, pull.started, pull.skip = transfer, time.monotonic(), skip
            if pull.handle is None:     # the context is called now: its wait starts again
                pull.deadline = pull.started + self.lease_seconds
        self._wake.set()
        return transfer

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.close()

    # ---- the reader thread ------------------------------------------------------------

    def _run(self) -> None:
        lower_thread_priority(READER_NICE, self.endpoint.name)
        while not self._stop.is_set():
            with self._lock:
                idle = not self._pulls
            self._wake.wait(None if idle else POLL_SECONDS)
            self._wake.clear()
            try:
                for sender, messages in self.endpoint.agent.notifs_by_peer().items():
                    self._deliver(sender, messages)
                with self._lock:
                    pulls = [(n, p) for n, p in self._pulls.items() if not p.busy]
                for nonce, pull in pulls:
                    for sender, msg in pull.backlog:
                        self._deliver(sender, [msg])
                    pull.backlog.clear()
                    if self._ended(pull):
                        self._forget(nonce)
                    elif self._has_work(pull):
                        pull.busy = True
                        self._dispatch(nonce, pull)
            except Exception:  # noqa: BLE001 - keep reading; each pull has its deadline
                _log.exception("overlapped KV reader of %s", self.endpoint.name)
        with self._lock:
            pulls, self._pulls = [p for p in self._pulls.values() if not p.busy], {}
        for pull in pulls:
            self._end(pull, None, ConnectorError("this KV connector is closed"))

    def _forget(self, nonce: str) -> None:
        with self._lock:
            self._pulls.pop(nonce, None)

    def _dispatch(self, nonce: str, pull: _Pull) -> None:
        """Queue ``pull`` on the reader thread of its context agent (made on first use; one
        that idled past ``PEER_IDLE_SECONDS`` left the table under the same lock)."""
        agent_name = pull.handle.agent_name
        with self._lock:
            peer = self._peers.get(agent_name)
            if peer is None:
                peer = self._peers[agent_name] = _PeerReader(self, agent_name)
            peer.put(nonce, pull)

    def retire(self, peer: "_PeerReader") -> bool:
        """May ``peer``'s idle thread end? Yes (and it leaves the table) if no job came."""
        with self._lock:
            if not peer.idle():
                return False
            if self._peers.get(peer.agent_name) is peer:
                del self._peers[peer.agent_name]
            return True

    def _deliver(self, sender: str, messages: list[bytes]) -> None:
        """File each notification of agent ``sender`` with its pull; others are ignored. A
        pull follows the context whose handle came last (a context that failed before it
        answered is replaced by the one the orchestrator tried next, which sends its own
        handle): what any other agent says about it is ignored."""
        for msg in messages:
            parsed = wire.parse(msg)
            if parsed is None:
                self.dropped.drop(MALFORMED, f"a notification from {sender} that is not of "
                                             f"this protocol: {msg[:64]!r}")
                continue
            with self._lock:
                pull = self._pulls.get(parsed[1])
            if pull is None:
                self.dropped.drop(UNKNOWN_REQUEST, f"a notification from {sender} for a pull "
                                                   f"that is not waiting (ended, or never was)")
                continue
            kind, _, payload = parsed
            if pull.handle is not None and sender != pull.handle.agent_name \
                    and kind != wire.HANDLE:
                continue
            if kind == wire.HANDLE and pull.busy:
                pull.backlog.append((sender, msg))       # not under its reader's feet
                continue
            try:
                if kind == wire.HANDLE:
                    if pull.handle is None or sender != pull.handle.agent_name:
                        self._take_handle(pull, payload)
                elif pull.handle is None and kind != wire.FAILED:
                    continue                     # a context's handle comes before the rest
                elif kind == wire.LAYERS:
                    pull.announced = max(pull.announced, int(payload))
                    pull.deadline = time.monotonic() + pull.handle.lease_seconds  # progress
                elif kind == wire.FIRST:
                    token, logprob = payload.split()
                    pull.first = (int(token), float(logprob))
                    pull.deadline = time.monotonic() + pull.handle.lease_seconds
                elif kind == wire.FAILED:
                    pull.failure = payload.decode(errors="replace")
            except Exception as exc:  # noqa: BLE001 - a bad one fails its pull alone
                pull.failure = f"bad {kind.decode()} notification: {exc}"

    def _take_handle(self, pull: _Pull, data: bytes) -> None:
        handle = self.check(data)
        if handle.num_tokens != pull.num_tokens:
            raise ValueError(f"the handle holds {handle.num_tokens} tokens of KV, the request's "
                             f"prompt has {pull.num_tokens}")
        if handle.geometry != self.endpoint.geometry:
            raise ValueError(f"overlap_transfer needs the same KV layout (tokens_per_block, "
                             f"dtype) on context and generation: {handle.geometry} against "
                             f"{self.endpoint.geometry}")
        now = time.monotonic()
        self._unpin(pull)                        # a context tried before this one
        pull.peer = self.endpoint.open_pull(handle, now)
        pull.handle, pull.deadline = handle, now + handle.lease_seconds
        pull.announced, pull.read, pull.first, pull.failure = 0, 0, None, None

    def _ended(self, pull: _Pull) -> bool:
        """End a pull that was cancelled, failed or ran out of time (dispatcher, the pull
        not busy); True if it ended."""
        if pull.transfer is not None and pull.transfer.cancelled.is_set():
            return self._end(pull, None, ConnectorError("cancelled"))
        if pull.failure is not None and pull.transfer is not None:
            return self._end(pull, None, ConnectorError(f"the context failed the overlapped "
                                                        f"KV transfer: {pull.failure}"))
        if time.monotonic() > pull.deadline:
            return self._end(pull, None, ConnectorError(
                f"overlapped KV transfer: no {'handle' if pull.handle is None else 'last layer'} "
                f"from the context within {time.monotonic() - pull.began:.1f} s"))
        return False

    @staticmethod
    def _ready(pull: _Pull, first: Optional[tuple[int, float]]) -> int:
        """Layers final at the context, ``first`` being the pull's first token as read
        *before* ``pull.announced`` (the context sends it after the last layer)."""
        layers = pull.handle.geometry.num_layers
        return layers if first is not None else min(pull.announced, layers)

    def _has_work(self, pull: _Pull) -> bool:
        return (pull.blocks is not None and pull.handle is not None
                and (pull.first is not None or self._ready(pull, None) > pull.read))

    def read(self, pull: _Pull, tickets) -> bool:
        """Read what the context announced into the sequence's blocks, and once the first
        token came, the ticket words (into ``tickets``, the peer reader's own registered
        buffer), which ends the lease; True once the pull ended (done, or failed).

        The dispatcher files notifications while this runs: the first token is taken once,
        before the layer count, so a FIRST that lands during the READs waits for the next
        pass instead of ending the pull with its last layers unread."""
        first = pull.first
        ready, began = self._ready(pull, first), time.monotonic()
        try:
            handle = kvhandle.tail(pull.handle, pull.skip) if pull.skip else pull.handle
            if ready > pull.read:
                pull.nbytes += self.endpoint.read_layers(pull.peer, handle, pull.blocks,
                                                         range(pull.read, ready), pull.deadline)
                pull.read = ready
            if first is not None:
                self.endpoint.confirm(pull.peer, handle, pull.deadline, tickets)
                if self.staged is not None:
                    self.staged(pull.blocks)
        except Exception as exc:  # noqa: BLE001 - that request fails alone
            return self._end(pull, None, exc)
        finally:
            pull.copy_seconds += time.monotonic() - began
        if first is None:
            return False
        return self._end(pull, TransferStats(pull.nbytes, pull.copy_seconds,
                                             time.monotonic() - pull.started, *first), None)

    def stepped(self, nonce: str, pull: _Pull, ended: bool) -> None:
        """A peer reader is done with ``pull`` for now (its thread)."""
        if ended:
            self._forget(nonce)
        pull.busy = False
        self._wake.set()

    def _end(self, pull: _Pull, stats: Optional[TransferStats],
             error: Optional[BaseException]) -> bool:
        self._unpin(pull)
        if pull.transfer is not None:
            pull.transfer.end(stats, error)
        return True

    def _unpin(self, pull: _Pull) -> None:
        """The pull READs from its context no more: its agent may go (LRU, idle)."""
        if pull.peer:
            self.endpoint.agent.unpin(pull.peer)
            pull.peer = ""


class _PeerReader:
    """The thread that READs the KV of one context agent's pulls, one at a time, into the
    pool (and their ticket words into its own registered buffer, so that no lock is shared
    with another peer's READs); it ends after ``PEER_IDLE_SECONDS`` without work."""

    def __init__(self, reader: LayerReader, agent_name: str):
        self.reader, self.agent_name = reader, agent_name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=guarded("overlapped KV reader", self._run, reader.on_death), daemon=True,
            name=f"{reader.endpoint.name}-from-{agent_name[:24]}")
        self._thread.start()

    def put(self, nonce: str, pull: _Pull) -> None:
        self._jobs.put((nonce, pull))

    def idle(self) -> bool:
        return self._jobs.empty()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5.0)

    def _run(self) -> None:
        lower_thread_priority(READER_NICE, self.agent_name)
        tickets = np.zeros(self.reader.endpoint.pool.shape[0], np.int64)   # [num_blocks]
        agent = self.reader.endpoint.agent
        reg = agent.register(tickets)
        try:
            while True:
                try:
                    job = self._jobs.get(timeout=PEER_IDLE_SECONDS)
                except queue.Empty:
                    if self.reader.retire(self):
                        return
                    continue
                if job is None:
                    return
                nonce, pull = job
                ended = False
                try:
                    ended = self.reader.read(pull, tickets)
                finally:
                    self.reader.stepped(nonce, pull, ended)
        finally:
            agent.unregister(reg)

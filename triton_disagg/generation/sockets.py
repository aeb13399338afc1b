"""The generation instance's ZeroMQ side: token events out, stops in.

- :class:`TokenOutbox` groups the token events of one decode step by orchestrator
  address and sends one message per address (PUSH, one socket per address, cached);
- :class:`StopInbox` is the instance's control socket (PULL), bound once; its address
  goes back to the orchestrator with each accepted request, and stops for this
  instance's requests arrive there; a frame that is not a stop is dropped and counted
  (``StopInbox.dropped``, :mod:`triton_disagg.readers`).

Invariants: only the decode-loop thread sends or receives on these sockets; nothing
here blocks. A send that would wait (the orchestrator is gone or not reading, and
``HIGH_WATER_MARK`` messages already wait for it) or fails closes that address's socket,
which drops every message still queued on it, and so does a disconnection (the
orchestrator closed its socket or died, or stopped answering heartbeats; what was on the
way may be lost), seen by each socket's monitor at the next flush; either way
:meth:`TokenOutbox.flush` reports the address, with this flush's events for it unsent:
the loop then fails every request that streams to it, never only those of the failed
message. At most ``MAX_SOCKETS`` sockets stay open after a flush: beyond that the
least recently used ones whose address no live request names are closed (given
``EVICT_LINGER_MS`` to deliver what they hold), as is a socket whose address had nothing
to send for ``IDLE_SECONDS`` (an orchestrator restarts with a new address), so dead
addresses do not pile up; the loop admits requests for at most ``MAX_SOCKETS`` distinct
addresses at a time.
"""

from __future__ import annotations

import logging
import time
from typing import Collection

import zmq

from triton_disagg import token_wire
from triton_disagg.readers import MALFORMED, DroppedFrames
from triton_disagg.token_wire import StreamEvent, WireError
from triton_disagg.zmq_endpoints import Endpoint, bind, push_socket

HIGH_WATER_MARK = 1000       # messages (decode steps) queued per orchestrator address
IDLE_SECONDS = 60.0          # a socket with nothing to send this long is closed
MAX_SOCKETS = 64             # open token sockets after a flush (distinct addresses)
EVICT_LINGER_MS = 1000       # what an evicted socket still holds gets this long to leave
STOP_READER = "generation stop inbox"     # the reader label of its dropped frames
_log = logging.getLogger(__name__)


class TokenOutbox:
    def __init__(self, context: zmq.Context, max_sockets: int = MAX_SOCKETS):
        self.context, self.max_sockets = context, max_sockets
        self.sockets: dict[str, zmq.Socket] = {}      # least recently used first
        self.monitors: dict[str, zmq.Socket] = {}     # each socket's disconnection events
        self.last_sent: dict[str, float] = {}
        self.pending: dict[str, list[StreamEvent]] = {}
        self.swept = time.monotonic()

    def put(self, address: str, event: StreamEvent) -> None:
        self.pending.setdefault(address, []).append(event)

    def flush(self, keep: Collection[str] = ()) -> dict[str, list[StreamEvent]]:
        """Send what was put since the last flush. Returns the addresses whose socket was
        dropped, each with the events of its failed message that were not errors; sockets
        beyond ``max_sockets`` whose address is not in ``keep`` are closed."""
        pending, self.pending = self.pending, {}
        dropped: dict[str, list[StreamEvent]] = {}
        now = time.monotonic()
        for address in [a for a, monitor in self.monitors.items() if _disconnected(monitor)]:
            _log.warning("generation: the orchestrator at %s disconnected; its socket is "
                         "closed and every request streaming to it fails", address)
            dropped[address] = [e for e in pending.pop(address, []) if e.error is None]
            self._drop(address)
        for address, events in pending.items():
            try:
                sock = self.sockets.pop(address, None) or self._connect(address)
                self.sockets[address] = sock                  # now the most recently used
                sock.send(token_wire.encode_events(events), zmq.NOBLOCK)
                self.last_sent[address] = now
            except Exception as exc:  # noqa: BLE001 - zmq.Again: HIGH_WATER_MARK messages wait
                _log.warning("generation: cannot send tokens to %s (%s); its socket is closed "
                             "and every request streaming to it fails", address, exc)
                dropped[address] = [e for e in events if e.error is None]
                self._drop(address)
        if now - self.swept >= IDLE_SECONDS:
            self.swept = now
            for address in [a for a, t in self.last_sent.items() if now - t >= IDLE_SECONDS]:
                self._drop(address)
        for address in [a for a in self.sockets if a not in keep
                        ][:max(0, len(self.sockets) - self.max_sockets)]:
            self._drop(address, EVICT_LINGER_MS)
        return dropped

    def _connect(self, address: str) -> zmq.Socket:
        sock = push_socket(self.context, address, HIGH_WATER_MARK)
        self.monitors[address] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        return sock

    def _drop(self, address: str, linger_ms: int = 0) -> None:
        sock = self.sockets.pop(address, None)
        self.last_sent.pop(address, None)
        monitor = self.monitors.pop(address, None)
        if monitor is not None:
            monitor.close(linger=0)
        if sock is not None:
            sock.close(linger=linger_ms)

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket; what is still unsent after ``linger_ms`` is dropped."""
        for address in list(self.sockets):
            self._drop(address, linger_ms)
        self.last_sent.clear()


def _disconnected(monitor: zmq.Socket) -> bool:
    """Whether ``monitor`` reported a disconnection since it was last asked."""
    seen = False
    while True:
        try:
            monitor.recv_multipart(zmq.NOBLOCK)    # [event id + value, endpoint]
        except zmq.Again:
            return seen
        seen = True


def send_errors(context: zmq.Context, events: list[tuple[str, StreamEvent]]) -> None:
    """Send ``(address, error event)`` pairs over sockets of the caller's own (for a thread
    other than the loop's), given a second to leave."""
    outbox = TokenOutbox(context)
    for address, event in events:
        outbox.put(address, event)
    outbox.flush()
    outbox.close(linger_ms=1000)


class StopInbox:
    """``host`` None: ipc in a private directory (orchestrators on this host); else tcp,
    advertised on ``host`` and bound on ``bind_host`` (default: ``host``'s address)."""

    def __init__(self, context: zmq.Context, host: str | None, bind_host: str | None = None):
        self.sock = context.socket(zmq.PULL, socket_class=zmq.Socket)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, token_wire.MAX_STOP_FRAME_BYTES)
        self.endpoint: Endpoint = bind(self.sock, host, "control", bind_host)
        self.dropped = DroppedFrames(STOP_READER)

    @property
    def address(self) -> str:
        return self.endpoint.address

    def take(self) -> list[tuple[str, str]]:
        """``(request id, key)`` of every stop that arrived (a key is an ASCII string;
        malformed frames are dropped and counted)."""
        stops = []
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return stops
            try:
                stops.append(token_wire.decode_stop(frame))
            except WireError as exc:
                self.dropped.drop(MALFORMED, f"a control frame: {exc}")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.endpoint.release()

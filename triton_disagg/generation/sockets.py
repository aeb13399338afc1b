"""The generation instance's ZeroMQ side: token events out, stops in.

- :class:`TokenOutbox` groups the token events of one decode step by orchestrator
  address and sends one message per address (PUSH, one socket per address, cached);
- :class:`StopInbox` is the instance's control socket (PULL), bound once; its address
  goes back to the orchestrator with each accepted request, and stops for this
  instance's requests arrive there.

Invariants: only the decode-loop thread sends or receives on these sockets; nothing
here blocks: a send that would wait (the orchestrator is gone or not reading, and
``HIGH_WATER_MARK`` messages already wait for it) or fails reports the request ids of
that message to the loop, which fails those requests and goes on. A socket is closed
after such a failure and once its address had nothing to send for ``IDLE_SECONDS``
(an orchestrator restarts with a new address), so dead addresses do not pile up.
"""

from __future__ import annotations

import logging
import time

import zmq

from triton_disagg import token_wire
from triton_disagg.token_wire import StreamEvent, WireError
from triton_disagg.zmq_endpoints import Endpoint, bind, push_socket

HIGH_WATER_MARK = 1000       # messages (decode steps) queued per orchestrator address
IDLE_SECONDS = 60.0          # a socket with nothing to send this long is closed
_log = logging.getLogger(__name__)


class TokenOutbox:
    def __init__(self, context: zmq.Context):
        self.context = context
        self.sockets: dict[str, zmq.Socket] = {}
        self.last_sent: dict[str, float] = {}
        self.pending: dict[str, list[StreamEvent]] = {}
        self.swept = time.monotonic()

    def put(self, address: str, event: StreamEvent) -> None:
        self.pending.setdefault(address, []).append(event)

    def flush(self) -> list[str]:
        """Send what was put since the last flush; the request ids that could not be sent."""
        pending, self.pending = self.pending, {}
        failed: list[str] = []
        now = time.monotonic()
        for address, events in pending.items():
            try:
                sock = self.sockets.get(address) or self._connect(address)
                sock.send(token_wire.encode_events(events), zmq.NOBLOCK)
                self.last_sent[address] = now
            except Exception as exc:  # noqa: BLE001 - zmq.Again: HIGH_WATER_MARK messages wait
                _log.warning("generation: cannot send tokens to %s (%s); failing %d request(s)",
                             address, exc, len(events))
                failed += [e.request_id for e in events]
                self._drop(address)
        if now - self.swept >= IDLE_SECONDS:
            self.swept = now
            for address in [a for a, t in self.last_sent.items() if now - t >= IDLE_SECONDS]:
                self._drop(address)
        return failed

    def _connect(self, address: str) -> zmq.Socket:
        self.sockets[address] = push_socket(self.context, address, HIGH_WATER_MARK)
        return self.sockets[address]

    def _drop(self, address: str) -> None:
        sock = self.sockets.pop(address, None)
        self.last_sent.pop(address, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket; what is still unsent after ``linger_ms`` is dropped."""
        for sock in self.sockets.values():
            sock.close(linger=linger_ms)
        self.sockets.clear()
        self.last_sent.clear()


def send_errors(context: zmq.Context, addresses: dict[str, str], message: str) -> None:
    """One error event per request (request id -> address), over sockets of the caller's
    own (for a thread other than the loop's), given a second to leave."""
    outbox = TokenOutbox(context)
    for request_id, address in addresses.items():
        outbox.put(address, StreamEvent(request_id, [], error=message))
    outbox.flush()
    outbox.close(linger_ms=1000)


class StopInbox:
    """``host`` None: ipc in a private directory (orchestrators on this host); else tcp,
    advertised on ``host`` and bound on ``bind_host`` (default: ``host``'s address)."""

    def __init__(self, context: zmq.Context, host: str | None, bind_host: str | None = None):
        self.sock = context.socket(zmq.PULL, socket_class=zmq.Socket)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint: Endpoint = bind(self.sock, host, "control", bind_host)

    @property
    def address(self) -> str:
        return self.endpoint.address

    def take(self) -> list[str]:
        """The request ids of every stop that arrived (malformed frames are logged, dropped)."""
        stops = []
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return stops
            try:
                stops.append(token_wire.decode_stop(frame))
            except WireError as exc:
                _log.warning("generation: dropped a control frame: %s", exc)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.endpoint.release()

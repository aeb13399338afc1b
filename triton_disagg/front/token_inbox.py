"""The orchestrator instance's ZeroMQ side: every generation instance sends its token
events to one PULL socket here; stops go back to the instance holding a request.

One reader task on the orchestrator's event loop decodes each message and hands every
event to its request's :class:`TokenStream` (a queue); events for a request nobody
waits for any more are dropped. A reader that falls behind catches up: the events of
a request that queued while its last response was being sent are taken as one (one
response for all their tokens, as vLLM's output collector merges deltas under load),
so the client path's cost per response is paid per response, not per token.

Invariants: a :class:`TokenStream` is registered before its generation request is sent,
so no event can arrive unclaimed; an event is taken only with its request's key (a
random string per stream, sent to generation inside ``token_address``): others are
dropped, logged and counted, so knowing a request id is not enough to add to a stream or
end it; the reader survives every frame (malformed, a wrong key of any content, an unknown
request: dropped and counted in ``TokenInbox.dropped``, :mod:`triton_disagg.readers`),
and a reader that dies anyway takes the instance down (``on_death``); events are taken
in sequence (0, 1, 2, ...): the first one out of order (an event was lost: a dropped
socket, a reconnect) ends the stream with an error, never a normal end with tokens
missing, and nothing after it is taken; :meth:`TokenStream.next` never waits longer than
``stall_seconds``, and after every ``PROBE_SECONDS`` of silence it asks whether the
generation server was lost (then it raises :class:`GenerationLost` at once); a stream left before generation sent its final event (client cancel,
stall, a failing send, an error, task cancellation) sends generation a stop, addressed
to the control socket that generation named when it accepted the request, with the key. A
stop socket to a control address no open stream names is closed once it has not been
used for ``STOP_IDLE_SECONDS`` (a restarted generation instance has a new one). The
socket file and its private directory are gone once :meth:`TokenInbox.close` returns.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import zmq
import zmq.asyncio

from triton_disagg import token_wire
from triton_disagg.engine.sequence import TokenEvent
from triton_disagg.errors import GenerationLost, Timeout, error_for
from triton_disagg.readers import (BAD_KEY, MALFORMED, UNKNOWN_REQUEST, DroppedFrames, OnDeath,
                                   fail_instance, watch_task)
from triton_disagg.token_wire import WireError, same_key
from triton_disagg.zmq_endpoints import Endpoint, bind, push_socket

STOP_HIGH_WATER_MARK = 100
PROBE_SECONDS = 1.0        # silence after which the stream asks if generation was lost
STOP_LINGER_MS = 500
STOP_IDLE_SECONDS = 60.0   # an unused stop socket no stream names is closed after this
_log = logging.getLogger(__name__)



@dataclass(frozen=True)
class GenerationAnswer:
    """Generation's answer to a request: where its stops go (empty: it declined a
    ``context_and_generation_if_cached`` request and holds nothing of it), and (a request
    awaiting the context, ``--overlap_kv_transfer``) the ``kv_listener`` to hand the context."""

    control_address: str
    kv_listener: bytes = b""

    @property
    def declined(self) -> bool:
        return not self.control_address

class TokenStream:
    """One request's token events, in order."""

    def __init__(self, inbox: "TokenInbox", request_id: str):
        self.inbox, self.request_id = inbox, request_id
        self.key = secrets.token_urlsafe(16)
        self.expected = 0                   # the sequence number of the next event
        self.broken = False                 # an event was lost: nothing more is taken
        self.events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.control: str | None = None     # the generation instance's control address
        self.ended = False                  # generation sent the final event
        self.held: TokenEvent | None = None  # an error event taken while merging, next up

    @property
    def token_address(self) -> str:
        """What generation is told to stream to: the inbox's address and this stream's key."""
        return token_wire.with_key(self.inbox.address, self.key)

    def deliver(self, event: TokenEvent) -> None:
        """Queue ``event`` when it carries this stream's key and the next sequence number;
        the first out of order queues an error instead, and ends what is taken."""
        if not same_key(event.key, self.key):
            self.inbox.dropped.drop(BAD_KEY, f"a token event for {self.request_id} without "
                                             f"its key")
            return
        if self.broken:
            return
        if event.seq != self.expected:
            self.events.put_nowait(TokenEvent(self.request_id, [], error=(
                f"token events of request {self.request_id} were lost on the way from "
                f"generation (expected event {self.expected}, got {event.seq}); request "
                f"failed")))
            self.broken = True
            return
        self.expected += 1
        self.events.put_nowait(event)

    async def accept(self, ack: Awaitable[GenerationAnswer]) -> GenerationAnswer:
        """Await generation's answer to the request (its control address, kept for stops)."""
        try:
            answer = await asyncio.wait_for(ack, self.inbox.stall_seconds)
            self.control = None if answer.declined else answer.control_address
            return answer
        except asyncio.TimeoutError:
            raise Timeout(f"generation did not accept the request within "
                              f"{self.inbox.stall_seconds:g} s (generation_server.stall_seconds)"
                              ) from None

    async def next(self, lost: Callable[[], Awaitable[GenerationLost | None]] | None = None
                   ) -> TokenEvent:
        """The next event merged with every later one already waiting (tokens in order; an
        error event is never merged, it comes next on its own); for an error event the error
        of its code (:func:`~triton_disagg.errors.error_for`), :class:`Timeout` for
        ``stall_seconds`` of silence; what ``lost()`` returns (asked after every
        ``PROBE_SECONDS`` of silence) when it is not None."""
        event, self.held = self.held, None
        if event is None:
            event = await self._wait(lost)
        taken = [event]
        while not taken[-1].final and not self.events.empty():
            later = self.events.get_nowait()
            if later.error is not None:
                self.held = later
                break
            taken.append(later)
        event = TokenEvent.joined(taken)
        self.ended = event.final
        if event.error is not None:
            raise error_for(event.code, event.error)
        return event

    async def _wait(self, lost: Callable[[], Awaitable[GenerationLost | None]] | None
                    ) -> TokenEvent:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.inbox.stall_seconds
        while True:
            try:
                return await asyncio.wait_for(self.events.get(),
                                              max(0.0, min(PROBE_SECONDS, deadline - loop.time())))
            except asyncio.TimeoutError:
                pass
            if loop.time() >= deadline:
                raise Timeout(f"generation sent no token for {self.inbox.stall_seconds:g} s "
                                  f"(generation_server.stall_seconds); the request was stopped")
            gone = await lost() if lost is not None else None
            if gone is not None:
                raise gone

    def __enter__(self) -> "TokenStream":
        return self

    def __exit__(self, *exc_info) -> None:
        self.inbox.streams.pop(self.request_id, None)
        if (not self.ended or self.broken) and self.control is not None:
            self.inbox.stop(self.control, self.request_id, self.key)
        self.inbox.prune()


class TokenInbox:
    """``host`` None: ipc in a private directory (generation on this host); else tcp on
    ``host``. Sockets are made on first use, on the event loop that serves requests.
    ``on_death(reader, exc)``: called if the reader task ends by an exception
    (:func:`~triton_disagg.readers.fail_instance`: the process exits)."""

    def __init__(self, host: str | None, stall_seconds: float,
                 on_death: OnDeath = fail_instance):
        self.host, self.stall_seconds, self.on_death = host, stall_seconds, on_death
        self.streams: dict[str, TokenStream] = {}
        self.context: zmq.asyncio.Context | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self.endpoint: Endpoint | None = None
        self.reader: asyncio.Task | None = None
        self.stop_sockets: dict[str, zmq.Socket] = {}
        self.stop_used: dict[str, float] = {}   # control address -> when last used
        self.pruned = time.monotonic()
        self.dropped = DroppedFrames("orchestrator token inbox")

    @property
    def address(self) -> str:
        return self.endpoint.address

    def open(self, request_id: str) -> TokenStream:
        """Register ``request_id``'s stream (on the event loop); use it as a context manager."""
        if self.reader is None:
            self.context = zmq.asyncio.Context()
            self.sock = self.context.socket(zmq.PULL)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, token_wire.MAX_TOKEN_FRAME_BYTES)
            self.endpoint = bind(self.sock, self.host, "tokens")
            self.reader = asyncio.get_running_loop().create_task(self._read())
            watch_task("orchestrator token reader", self.reader, self.on_death)
        stream = self.streams[request_id] = TokenStream(self, request_id)
        return stream

    def stop(self, control: str, request_id: str, key: str) -> None:
        """Ask the generation instance at ``control`` to stop ``request_id`` (never blocks)."""
        sock = self.stop_sockets.get(control)
        if sock is None:
            sock = self.stop_sockets[control] = push_socket(self.context, control,
                                                            STOP_HIGH_WATER_MARK)
        self.stop_used[control] = time.monotonic()
        try:
            sock.send(token_wire.encode_stop(request_id, key), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            _log.warning("orchestrator: could not send a stop to %s (%s)", control, exc)

    def prune(self) -> None:
        """Close the stop sockets no open stream names that were not used for
        ``STOP_IDLE_SECONDS`` (looked at most once per ``STOP_IDLE_SECONDS``)."""
        now = time.monotonic()
        if now - self.pruned < STOP_IDLE_SECONDS:
            return
        self.pruned = now
        named = {stream.control for stream in self.streams.values()}
        for control in [c for c, t in self.stop_used.items()
                        if c not in named and now - t >= STOP_IDLE_SECONDS]:
            self.stop_sockets.pop(control).close(linger=STOP_LINGER_MS)
            del self.stop_used[control]

    async def _read(self) -> None:
        """Take frames until cancelled; a frame it cannot use is dropped and counted."""
        while True:
            try:
                frame = await self.sock.recv()
            except zmq.ZMQError as exc:
                _log.error("orchestrator: token socket failed (%s); reading on", exc)
                await asyncio.sleep(0.1)
                continue
            self._take(frame)

    def _take(self, frame: bytes) -> None:
        try:
            events = token_wire.decode_events(frame)
        except WireError as exc:
            self.dropped.drop(MALFORMED, f"a token frame: {exc}")
            return
        for event in events:
            stream = self.streams.get(event.request_id)
            if stream is None:
                self.dropped.drop(UNKNOWN_REQUEST, f"a token event for {event.request_id!r}, "
                                                   f"which no stream waits for")
            else:
                stream.deliver(event)

    def close(self, timeout: float = 2.0) -> None:
        """Remove the ipc file, stop reading and close the sockets (``finalize``, any thread).

        The sockets belong to the event loop's thread, so they are closed there; when that
        loop does not come round within ``timeout`` they are left to the process's exit."""
        reader, self.reader = self.reader, None
        if reader is None:
            return
        self.endpoint.release()
        loop = reader.get_loop()
        if not loop.is_running() or _on_loop(loop):
            self._close_sockets(reader)
            return
        closed = threading.Event()
        loop.call_soon_threadsafe(lambda: (self._close_sockets(reader), closed.set()))
        if not closed.wait(timeout):
            _log.warning("orchestrator: event loop busy at finalize; token sockets left open")

    def _close_sockets(self, reader: asyncio.Task) -> None:
        reader.cancel()
        self.sock.close(linger=0)
        for sock in self.stop_sockets.values():
            sock.close(linger=STOP_LINGER_MS)     # stops sent just before still leave
        self.context.term()


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False

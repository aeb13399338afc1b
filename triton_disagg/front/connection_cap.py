"""The HTTP front's connections (:mod:`.http_gates` says what every gate does): at most
``max_connections`` open (:class:`CappedRunner`, :class:`ConnectionCap`), the oldest that
has sent nothing making room for a new one, and each dropped when its client takes nothing
of its answer for ``write_timeout_seconds`` (:class:`_Counted`)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable

from aiohttp import web

from triton_disagg.front.http_gates import RETRY_AFTER_SECONDS, busy

REFUSAL_LINGER_SECONDS = 2.0     # a refused connection's request is waited for this long
log = logging.getLogger("triton_disagg.front")


class _Counted(asyncio.Protocol):
    """The app's protocol for one connection, counted open until its connection is lost,
    and dropped when what it wrote is not all taken by its client within
    ``cap.write_timeout`` seconds.

    The transport's high water mark is 0, so it pauses writing (:meth:`pause_writing`) as
    soon as a byte stays in its buffer (the kernel's socket buffer is full: the client is
    not reading) and resumes when the buffer is empty again: a connection paused for
    ``cap.write_timeout`` s is aborted (``cap.on_stalled`` counts it), whatever route wrote
    (a generation's stream, ``/openapi.json``, an error, pipelined requests nobody reads)
    and also while it is closing (a ``Connection: close`` answer or a keep-alive timeout
    whose last bytes nobody takes: asyncio would otherwise wait for ever to send them).
    aiohttp's handler sees its write fail and, with ``handler_cancellation``, is cancelled.
    """

    def __init__(self, inner: asyncio.Protocol, cap: "ConnectionCap"):
        self.inner, self.cap = inner, cap
        self.transport: asyncio.Transport | None = None
        self.stall: asyncio.TimerHandle | None = None
        self.counted = True          # in cap.open; False once evicted (counted off then)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport   # type: ignore[assignment]
        self.inner.connection_made(transport)
        self.transport.set_write_buffer_limits(high=0)    # paused while a byte waits
        if not self.counted:         # evicted before it was made
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        self.cap.silent.pop(self, None)
        self.inner.data_received(data)

    def evict(self) -> None:
        """Close this connection, which has sent nothing yet, to make room for a new one."""
        self.cap.silent.pop(self, None)
        self.counted = False
        self.cap.open -= 1
        if self.transport is not None:
            self.transport.abort()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()
        self.stall = asyncio.get_running_loop().call_later(self.cap.write_timeout, self._drop)

    def resume_writing(self) -> None:
        self._unarm()
        self.inner.resume_writing()

    def _drop(self) -> None:
        self.stall = None
        if self.transport is not None:                   # closing too: its tail unsent
            log.warning("a client took nothing of its answer for %g s; its connection "
                        "dropped", self.cap.write_timeout)
            self.cap.on_stalled()
            self.transport.abort()

    def _unarm(self) -> None:
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._unarm()
        self.transport = None
        self.cap.silent.pop(self, None)
        if self.counted:
            self.cap.open -= 1
        self.inner.connection_lost(exc)


class _Refused(asyncio.Protocol):
    """A connection past the cap: once its request starts arriving (or after
    ``REFUSAL_LINGER_SECONDS``), a 503 and close."""

    def __init__(self, limit: int):
        self.limit = limit
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport   # type: ignore[assignment]
        asyncio.get_running_loop().call_later(REFUSAL_LINGER_SECONDS, self._answer)

    def data_received(self, data: bytes) -> None:
        self._answer()

    def _answer(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        error = busy(f"{self.limit} open connections (front.max_connections)", 503)
        body = json.dumps(error.body()).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Retry-After: {RETRY_AFTER_SECONDS}\r\nContent-Length: {len(body)}\r\n"
                f"Connection: close\r\n\r\n").encode()
        self.transport.write(head + body)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


class ConnectionCap:
    """A protocol factory: the app's protocol while fewer than ``limit`` connections are
    open (each dropped when its client does not take what was written within
    ``write_timeout`` s), else a refusal. At the cap, a new connection first takes the place
    of the oldest open one that has sent nothing yet (``silent``), so clients that open
    connections and say nothing cannot hold every place; only connections with a request
    under way (or kept alive after one, until ``idle_timeout_seconds``) make a refusal.

    Invariant: ``open`` counts the connections admitted and neither lost nor evicted, at
    most ``limit``; ``silent`` holds, oldest first, those of them that have received no byte."""

    def __init__(self, server: web.Server, limit: int, write_timeout: float,
                 on_refused: Callable[[], None], on_stalled: Callable[[], None]):
        self.server, self.limit, self.open, self.write_timeout = server, limit, 0, write_timeout
        self.on_refused, self.on_stalled = on_refused, on_stalled
        self.silent: dict[_Counted, None] = {}       # insertion order: oldest first

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.limit and self.silent:
            next(iter(self.silent)).evict()
        if self.open >= self.limit:
            self.on_refused()
            return _Refused(self.limit)
        self.open += 1
        admitted = _Counted(self.server(), self)
        self.silent[admitted] = None
        return admitted


class CappedRunner(web.AppRunner):
    """aiohttp's ``AppRunner`` whose sites accept at most ``max_connections`` connections
    and drop one whose client does not take what was written within ``write_timeout`` s;
    ``on_refused`` is called for each connection refused, ``on_stalled`` for each dropped."""

    def __init__(self, app: web.Application, max_connections: int, write_timeout: float,
                 on_refused: Callable[[], None] = lambda: None,
                 on_stalled: Callable[[], None] = lambda: None, **kwargs):
        super().__init__(app, **kwargs)
        self.max_connections, self.write_timeout = max_connections, write_timeout
        self.on_refused, self.on_stalled = on_refused, on_stalled
        self._cap: ConnectionCap | None = None

    @property
    def server(self):   # what a site's loop.create_server calls for each connection
        inner = super().server
        if inner is None:
            return None
        if self._cap is None or self._cap.server is not inner:
            self._cap = ConnectionCap(inner, self.max_connections, self.write_timeout,
                                      self.on_refused, self.on_stalled)
        return self._cap

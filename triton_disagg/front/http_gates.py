"""Every gate a request to the HTTP front passes before its handler, per connection and per
request, and the counts they keep (the config's ``front`` section,
:class:`~triton_disagg.config.front_section.FrontConfig`).

Admission: how many connections and generation requests the front holds at once, and how
long it waits on a client.

- Connections: :class:`CappedRunner` serves an app like aiohttp's ``AppRunner``, but holds
  at most ``max_connections`` open (:class:`ConnectionCap`). At the cap a new connection
  first takes the place of the oldest open one that has sent nothing yet, so clients that
  open connections and say nothing cannot hold every place; only when each open one has a
  request under way (or is kept alive after one) is the new one answered ``503`` with
  ``Retry-After`` (OpenAI's error JSON) and closed, without reaching the app.
- Requests: :func:`request_gate` lets ``max_concurrent_requests`` generation requests
  (``GATED_PATHS``) in at once, from before their body is read to their last byte out; one
  more is answered ``429`` with ``Retry-After`` at once, never queued, unless a request
  whose body has been arriving for ``BODY_GRACE_SECONDS`` or more holds a place: the
  oldest such is cut to make room (:class:`RequestCount`), so a request that trickles its
  body holds its place for at most that long once another needs it, and a body on its way
  in a burst is not cut.
- Slow clients: a connection whose client takes nothing more for ``write_timeout_seconds``
  while its answer waits to go out is dropped (:class:`_Counted`), whatever the route: a
  generation's stream or whole answer, ``/openapi.json``, an error, pipelined requests
  nobody reads, a closing connection's last bytes. Its handler is cancelled, which ends the
  request, cancels its generation and frees its KV blocks; an answer nobody reads holds no
  connection.
  Headers and the idle time between requests are bounded by aiohttp's keep-alive timer
  (``idle_timeout_seconds``: aiohttp 3.14 arms it when a connection opens), a request's
  body by :func:`~triton_disagg.front.openai_api.read_json`.

Invariants: at most ``max_connections`` connections are counted open and at most
``max_concurrent_requests`` orchestrator calls in flight; the counts go back down on every
way out (a response, an error, a client that left, a cancelled handler, a lost or evicted
connection); a refusal costs no body read, no parsing and no engine call.

Browsers (:func:`add_origin_guard`): a web page must not be able to call a front on the
user's machine or network (a cross-site ``fetch``, or DNS rebinding, where a name the page
controls resolves to 127.0.0.1). The rule, for every path:

- a request carrying an ``Origin`` header (browsers send one on every cross-origin request
  and on every POST) is refused with 403 unless that origin is in
  ``front.allowed_origins`` (exact ``scheme://host[:port]``, or ``"*"``); an allowed one gets
  ``Access-Control-Allow-Origin`` back. API clients (the OpenAI SDK, curl, requests) send
  no ``Origin`` and are not affected;
- when the front listens on a loopback address, or ``front.allowed_hosts`` is set, the
  ``Host`` header's name must be a loopback one (``localhost``, 127.0.0.0/8, ``::1``) or in
  ``front.allowed_hosts``, else 403: a rebound name never matches. A front on a routable
  address with no ``allowed_hosts`` accepts any Host (it is reached under names it cannot
  know).

Metrics (:class:`FrontMetrics`): the front's own ``GET /metrics``, in Prometheus' text
format (0.0.4), beside Triton's on its metrics port: requests by route and status, requests
in flight, and refusals by the admission caps. Every label value comes from a bounded set
(a route's pattern, never its path: an unknown path counts as ``unmatched``; an HTTP status;
a cap's name), so no client can grow the exposition; a request counts once, when it ends,
``client_closed`` when the client left first; in flight goes back down on every way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from typing import Awaitable, Callable, Iterator

from aiohttp import web

from triton_disagg.config.front_section import FrontConfig
from triton_disagg.config.values import is_loopback
from triton_disagg.front.openai_api import BODY_ARRIVED, ApiError

GATED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/inference",
                         "/tokenize", "/detokenize"})   # each reads a body, then works on it
RETRY_AFTER_SECONDS = 1
BODY_GRACE_SECONDS = 1.0   # a body arriving for less is not cut for room: at most Retry-After
REFUSAL_LINGER_SECONDS = 2.0     # a refused connection's request is waited for this long
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
log = logging.getLogger("triton_disagg.front")


def busy(what: str, status: int) -> ApiError:
    """The refusal of a request or connection past a cap: ``status`` with ``Retry-After``."""
    kind = "rate_limit_error" if status == 429 else "server_error"
    return ApiError(f"the server is at its limit of {what}; retry after {RETRY_AFTER_SECONDS} s",
                    status, kind=kind, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


# ---- connections: max_connections and slow clients

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


# ---- requests: max_concurrent_requests

class Place:
    """One request's place under a :class:`RequestCount`'s cap, held from before its body
    is read until it ends (:meth:`leave`), or until the cap needs it back while the body is
    still arriving (:meth:`evict`: its connection is closed)."""

    def __init__(self, count: "RequestCount", transport: asyncio.BaseTransport | None):
        self.count, self.transport, self.held = count, transport, True
        self.entered = time.monotonic()
        count.in_flight += 1
        count.arriving[self] = None

    def arrived(self) -> None:
        """The body is all here: the place is kept until the request ends."""
        self.count.arriving.pop(self, None)

    def evict(self) -> None:
        """Give the place to a new request: this one, whose body is still arriving, is cut
        (its connection closed; its handler, cancelled, then leaves)."""
        log.warning("a request's body was still arriving at the cap of %d requests; its "
                    "connection closed to make room", self.count.limit)
        self.leave()
        if self.transport is not None:
            self.transport.abort()

    def leave(self) -> None:
        """The request ended (on every way out; again: nothing)."""
        self.count.arriving.pop(self, None)
        if self.held:
            self.held = False
            self.count.in_flight -= 1


class RequestCount:
    """Orchestrator calls in flight, at most ``limit``: a request holds a :class:`Place`
    from before its body is read (:meth:`enter`; so at most ``limit`` bodies are read or held
    at once), and one more call per extra choice once it is parsed (:meth:`more`), so a
    request of ``n`` choices counts as the ``n`` calls it makes.

    A request whose body is still arriving holds its place only until another request needs
    it and ``BODY_GRACE_SECONDS`` have passed since it entered: at the cap, a new request takes
    the place of the oldest one that has been arriving that long (that one is cut,
    :meth:`Place.evict`), else is refused. So a request that trickles its body holds its
    place for at most that long once another needs it (no longer than a client told
    ``Retry-After`` waits; a client that keeps opening such requests keeps taking places
    back, as one that sends valid long requests holds them longer), and a body still on
    its way when a burst reaches the cap (headers and body come in separate reads) is not
    cut; a request still sending its body holds, in the end, only a connection (bounded by
    ``front.max_connections`` and the body timeout).

    Invariant: ``in_flight`` is the places held plus the extra calls of :meth:`more`, at most
    ``limit``; ``arriving`` holds, oldest first, the places whose body is still arriving."""

    def __init__(self, limit: int):
        self.limit, self.in_flight = limit, 0
        self.arriving: dict[Place, None] = {}       # insertion order: oldest first

    def enter(self, transport: asyncio.BaseTransport | None) -> Place | None:
        """A place for a new request on ``transport`` (at the cap, the oldest one arriving
        for ``BODY_GRACE_SECONDS`` or more cut to make room), None when every place is held
        by a request whose body has arrived or began arriving less than that ago."""
        if self.in_flight >= self.limit and self.arriving:
            oldest = next(iter(self.arriving))
            if time.monotonic() - oldest.entered >= BODY_GRACE_SECONDS:
                oldest.evict()
        if self.in_flight >= self.limit:
            return None
        return Place(self, transport)

    @contextlib.contextmanager
    def more(self, calls: int) -> Iterator[None]:
        """Hold ``calls`` more for the block; 429 at once when they do not fit."""
        if self.in_flight + calls > self.limit:
            raise busy(f"{self.limit} concurrent requests (front.max_concurrent_requests; "
                       f"a request counts once per choice)", 429)
        self.in_flight += calls
        try:
            yield
        finally:
            self.in_flight -= calls


def request_gate(count: RequestCount):
    """The middleware that admits at most ``count.limit`` requests to ``GATED_PATHS``; each
    request's place is marked arrived by :func:`~.openai_api.read_json` once its body is
    read (``BODY_ARRIVED``)."""

    @web.middleware
    async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in GATED_PATHS:
            return await handler(request)
        place = count.enter(request.transport)
        if place is None:
            raise busy(f"{count.limit} concurrent requests (front.max_concurrent_requests)", 429)
        request[BODY_ARRIVED] = place.arrived
        try:
            return await handler(request)
        finally:
            place.leave()
    return gate


# ---- browsers: Origin and Host

ALLOWED_ORIGIN = web.RequestKey("allowed_origin", str)


def host_name(host_header: str) -> str:
    """``Host``'s name without its port: ``[::1]:80`` -> ``::1``, ``a.b:80`` -> ``a.b``."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def add_origin_guard(app: web.Application, config: FrontConfig, bound_host: str) -> None:
    """Enforce the module's rule on ``app`` (a front listening on ``bound_host``): a
    middleware after those ``app`` has, and the allowed origin echoed on every response."""
    origins = set(config.allowed_origins)
    hosts = {h.lower() for h in config.allowed_hosts}
    check_host = bool(hosts) or is_loopback(bound_host)

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin is not None and origin not in origins and "*" not in origins:
            raise ApiError(f"requests from origin {origin[:100]!r} are refused; add it to "
                           f"front.allowed_origins to allow it", 403, kind="permission_error")
        host = request.headers.get("Host")
        if check_host and host is not None:
            name = host_name(host).lower()
            if not is_loopback(name) and name not in hosts:
                raise ApiError(f"Host {host[:100]!r} is not a name of this server; add it to "
                               f"front.allowed_hosts to allow it", 403, kind="permission_error")
        if origin is not None:
            request[ALLOWED_ORIGIN] = origin
        return await handler(request)

    async def allow_origin(request: web.Request, response: web.StreamResponse) -> None:
        if ALLOWED_ORIGIN in request:
            response.headers["Access-Control-Allow-Origin"] = request[ALLOWED_ORIGIN]
            response.headers["Vary"] = "Origin"

    app.middlewares.append(guard)
    app.on_response_prepare.append(allow_origin)


# ---- the front's metrics

PREFIX = "disagg_front"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REQUEST_CAP, CONNECTION_CAP = "max_concurrent_requests", "max_connections"


class FrontMetrics:
    """The counts, and the middleware that keeps them."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()     # (route, status) -> ended
        self.refusals: Counter[str] = Counter({REQUEST_CAP: 0, CONNECTION_CAP: 0})
        self.in_flight = 0
        self.stalled = 0                                          # connections dropped

    def refused_connection(self) -> None:
        """A connection past ``front.max_connections`` (the runner's hook)."""
        self.refusals[CONNECTION_CAP] += 1

    def stalled_connection(self) -> None:
        """A connection dropped past ``front.write_timeout_seconds`` (the runner's hook)."""
        self.stalled += 1

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        self.in_flight += 1
        status = "client_closed"
        try:
            response = await handler(request)
            status = str(response.status)
            return response
        except web.HTTPException as exc:
            status = str(exc.status)
            raise
        except (ConnectionError, asyncio.CancelledError):
            raise
        finally:
            self.in_flight -= 1
            self.requests[(route, status)] += 1
            if status == "429":
                self.refusals[REQUEST_CAP] += 1

    def exposition(self) -> str:
        lines = [f"# HELP {PREFIX}_requests_total HTTP requests the front answered, by route "
                 f"and status", f"# TYPE {PREFIX}_requests_total counter"]
        lines += [f'{PREFIX}_requests_total{{route="{route}",status="{status}"}} {n}'
                  for (route, status), n in sorted(self.requests.items())]
        lines += [f"# HELP {PREFIX}_requests_in_flight HTTP requests being answered now",
                  f"# TYPE {PREFIX}_requests_in_flight gauge",
                  f"{PREFIX}_requests_in_flight {self.in_flight}",
                  f"# HELP {PREFIX}_refusals_total requests (429) and connections (503) "
                  f"refused by an admission cap", f"# TYPE {PREFIX}_refusals_total counter"]
        lines += [f'{PREFIX}_refusals_total{{cap="{cap}"}} {n}'
                  for cap, n in sorted(self.refusals.items())]
        lines += [f"# HELP {PREFIX}_stalled_connections_total connections dropped because "
                  f"their client did not take what was written within "
                  f"front.write_timeout_seconds",
                  f"# TYPE {PREFIX}_stalled_connections_total counter",
                  f"{PREFIX}_stalled_connections_total {self.stalled}"]
        return "\n".join(lines) + "\n"


def add_metrics_route(app: web.Application, metrics: FrontMetrics) -> None:
    """``GET /metrics`` on ``app``, and the counting middleware outermost."""
    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition().encode(),
                            headers={"Content-Type": CONTENT_TYPE})
    app.middlewares.insert(0, metrics.middleware)
    app.router.add_get("/metrics", serve)

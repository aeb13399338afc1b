"""The public door's HTTP side: Triton's HTTP port of ``serve all`` and ``serve
scheduler``, answered in the HTTP front's process and forwarded to tritonserver on loopback
(the gRPC side and why: :mod:`.public_door`); :func:`open_doors` opens both.

HTTP (aiohttp): method, path and query as sent, headers less the hop-by-hop ones, and the
body are forwarded; the answer streams back as it comes (Triton's ``generate_stream``
events included).

Invariants: a body over ``max_bytes`` is refused (413) from its ``Content-Length`` before it
is read, or, chunked, once ``max_bytes`` have come; a body slower than ``body_timeout`` is
408; a ``Content-Type`` other than Triton's (JSON, octet stream) is not forwarded (a large
form body kills Triton 2.51's HTTP server); a compressed body (``Content-Encoding``) is 415,
since Triton would inflate it unbounded; so tritonserver never receives more than
``max_bytes`` in one request. At most ``max_calls`` requests are read or forwarded at once
(429 with ``Retry-After``), over at most ``front.max_connections`` connections; at the cap,
a new request takes the place of the oldest one whose body has been arriving for
``BODY_GRACE_SECONDS`` (that one's connection closed:
:class:`~triton_disagg.front.http_gates.RequestCount`), so a request that trickles its body
holds its place for at most that long once another needs it; a bodiless
``GET /v2/health/live`` or ``/ready`` is never counted or refused by the request cap. The door checks
``Origin`` and ``Host`` as the front does (a web page cannot drive it). Nothing is
forwarded unless this user listens on the inner port
(:class:`~triton_disagg.front.door_guards.InnerOwner`); an unreachable tritonserver is 502.

Every body is JSON to Triton but an ``infer`` request's binary tensors after its
``Inference-Header-Content-Length`` bytes, and Triton's parser (rapidjson) holds each JSON
value as an object (a 9 MB body of 3 million empty strings took tritonserver 100 MB, one of
4M numbers 136 MB: no number is held in 4-8 bytes as in the gRPC door's protobuf, so its
``MAX_NUMBERS`` is no bound here). So a body whose JSON part has more than ``MAX_ENTRIES``
strings (keys included) or values of any kind is refused (400), counted from its bytes
(:func:`json_size`: an object per string at most), as is an inference request (``infer``,
``generate``, ``generate_stream``) naming a model not in ``models`` (when given;
:func:`screen_body`). Bodies forwarded and not yet answered (until the answer has been
relayed, or the request ended otherwise) are held in ``budget``
(:class:`~triton_disagg.front.door_guards.ByteBudget`; :func:`open_doors` gives both doors
the gRPC door's): of the request's own reserve first (a body of at most the budget's
``per_call`` bytes never waits for others'), the rest of its shared pool; a body past the
pool waits, up to ``body_timeout`` (then 503 with ``Retry-After``). So the door holds at
most the pool plus ``max_calls`` reserves. Each chunk of an answer must be written to the
client within ``answer_seconds`` of when it came from tritonserver (at most
``QUEUED_CHUNKS`` wait in the door; timed on the doors'
:class:`~triton_disagg.front.door_guards.LoopClock`, so the door's own stalls do not
count), else the connection is cut mid-answer (never a normal end) and the body's bytes
given back: a client that reads slowly holds the budget no longer than one that reads
nothing.
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
from dataclasses import dataclass
from typing import Awaitable, Callable

import aiohttp
from aiohttp import web

from triton_disagg.config.front_section import FrontConfig
from triton_disagg.config.tls_section import GrpcTLS
from triton_disagg.front.door_guards import (CALL_RESERVE, CLIENT_SECONDS, MAX_ENTRIES,
                                             OUTSTANDING_MESSAGES, UNREACHABLE, BudgetFull,
                                             ByteBudget, InnerOwner, LoopClock, Refused,
                                             refuse_unserved)
from triton_disagg.front.http_gates import (RETRY_AFTER_SECONDS, Place, RequestCount,
                                           add_origin_guard)
from triton_disagg.front.openai_api import ApiError, json_size
from triton_disagg.front.public_door import GrpcDoor
from triton_disagg.triton.endpoints import LOOPBACK

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
                        "host", "content-length"})
PASSED_MEDIA_TYPES = frozenset({"application/json", "application/octet-stream"})
CONNECT_SECONDS = 5.0       # to reach tritonserver's HTTP port, a pooled connection or a new one
PROBES = frozenset({"/v2/health/live", "/v2/health/ready"})   # a bodiless GET: never capped
# Triton's own routing of an inference request (http_server.cc's model_regex_), on the raw path
INFERENCE_PATH = re.compile(
    r"/v2/models/([^/]+)(?:/versions/[0-9]+)?/(infer|generate|generate_stream)")
BINARY_HEADER = "Inference-Header-Content-Length"   # infer's JSON part; raw tensors after it
QUEUED_CHUNKS = 4   # chunks of one answer read from tritonserver, waiting for the client


@dataclass(frozen=True)
class DoorPorts:
    """Where the door listens (``host``, the public ports) and where tritonserver does
    (loopback, ``inner_*``); an HTTP pair of None: no HTTP door."""

    host: str
    grpc_port: int
    inner_grpc_port: int
    http_port: int | None = None
    inner_http_port: int | None = None



INNER = web.AppKey("inner", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)
CALLS = web.AppKey("calls", RequestCount)       # requests being forwarded, probes aside
BUDGET = web.AppKey("budget", ByteBudget)        # bytes of bodies forwarded, not yet answered
CLOCK = web.AppKey("clock", LoopClock)           # times what the door asks of clients
ANSWER_SECONDS = web.AppKey("answer_seconds", float)


def _error(status: int, message: str) -> web.Response:
    """Triton's HTTP error body: ``{"error": "..."}``."""
    return web.json_response({"error": message}, status=status)


def make_http_door(inner: str, max_bytes: int, max_calls: int, body_timeout: float,
                   owner: InnerOwner | None = None, models: frozenset[str] = frozenset(),
                   budget: ByteBudget | None = None, clock: LoopClock | None = None,
                   answer_seconds: float = CLIENT_SECONDS) -> web.Application:
    """An aiohttp app forwarding every request to ``http://inner`` (module docstring);
    ``budget`` defaults to one of ``OUTSTANDING_MESSAGES`` bodies of ``max_bytes`` and
    ``CALL_RESERVE`` a request,
    ``clock`` to one of the app's own (started and stopped with it)."""
    owner = owner or InnerOwner((int(inner.rsplit(":", 1)[1]),))

    async def forward(request: web.Request) -> web.StreamResponse:
        if (request.content_length or 0) > max_bytes:
            return _error(413, f"the body is over {max_bytes} bytes")
        encodings = request.headers.getall("Content-Encoding", [])
        if [e.strip().lower() for e in encodings] not in ([], ["identity"]):
            return _error(415, "a compressed body is not taken (Triton would inflate it "
                               "unbounded); send it as is")
        if not await owner.ours():
            return _error(503, f"{UNREACHABLE} (its port is not this server's)")
        if request.method == "GET" and request.path in PROBES and not request.body_exists:
            return await _forward(request, max_bytes, body_timeout, models, None)
        place = request.app[CALLS].enter(request.transport)
        if place is None:
            busy = _error(429, f"over {max_calls} requests in flight; retry later")
            busy.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
            return busy
        try:
            return await _forward(request, max_bytes, body_timeout, models, place)
        finally:
            place.leave()

    async def open_session(app: web.Application) -> None:
        # no pool limit (aiohttp's default, 100, would make the requests past it, probes
        # included, wait for a pooled connection unbounded): the door caps calls itself
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(connect=CONNECT_SECONDS, sock_connect=CONNECT_SECONDS))

    async def close_session(app: web.Application) -> None:
        await app[SESSION].close()

    @web.middleware
    async def triton_errors(request: web.Request, handler) -> web.StreamResponse:
        """A refusal of the gates added after this one (the origin guard), as Triton's body."""
        try:
            return await handler(request)
        except ApiError as exc:
            refused = _error(exc.status, str(exc))
            refused.headers.update(exc.headers)
            return refused

    async def start_clock(app: web.Application) -> None:
        app[CLOCK].start()

    async def stop_clock(app: web.Application) -> None:
        await app[CLOCK].stop()

    app = web.Application(client_max_size=max_bytes, middlewares=[triton_errors])
    app[INNER], app[CALLS] = inner, RequestCount(max_calls)
    app[BUDGET] = budget or ByteBudget(OUTSTANDING_MESSAGES * max_bytes, CALL_RESERVE)
    app[CLOCK], app[ANSWER_SECONDS] = clock or LoopClock(), answer_seconds
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    if clock is None:                   # else its owner's (the gRPC door's) to start
        app.on_startup.append(start_clock)
        app.on_cleanup.append(stop_clock)
    app.router.add_route("*", "/{path:.*}", forward)
    return app


async def _forward(request: web.Request, max_bytes: int, body_timeout: float,
                   models: frozenset[str], place: Place | None) -> web.StreamResponse:
    """Read the body (``place``, the request's under the cap, marked arrived then; None for
    a probe, which has no body), screen it, take its bytes from the budget (a reserve of
    its own first) and relay it."""
    try:
        async with asyncio.timeout(body_timeout):
            body = await request.read()         # at most client_max_size, else 413
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"the body is over {max_bytes} bytes")
    except TimeoutError:
        return _error(408, f"the body did not arrive within {body_timeout:g} s")
    if place is not None:
        place.arrived()
    try:
        screen_body(request.rel_url.raw_path, request.headers.get(BINARY_HEADER), body, models)
    except Refused as refused:
        return _error(400, str(refused))
    budget = request.app[BUDGET]
    try:
        taken = await budget.take_within(len(body), body_timeout, budget.reserve())
    except BudgetFull as full:
        busy = _error(503, str(full))
        busy.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return busy
    try:
        return await _relay(request, body)
    finally:
        budget.give(taken)


async def _relay(request: web.Request, body: bytes) -> web.StreamResponse:
    """Send ``body`` on to tritonserver and stream its answer back."""
    headers = [(k, v) for k, v in request.headers.items()
               if k.lower() not in HOP_BY_HOP and (k.lower() != "content-type"
                                                    or _passed_media_type(v))]
    url = f"http://{request.app[INNER]}{request.rel_url.raw_path_qs}"   # origin-form only
    try:
        upstream = await request.app[SESSION].request(
            request.method, url, headers=headers, data=body or None, allow_redirects=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"))
    except aiohttp.ClientError:
        return _error(502, UNREACHABLE)
    async with upstream:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        response.headers.extend((k, v) for k, v in upstream.headers.items()
                                if k.lower() not in HOP_BY_HOP - {"content-length"})
        await response.prepare(request)
        try:
            await _answer(request, response, upstream.content)
        except (TimeoutError, aiohttp.ClientError):
            _cut(request)
            return response
        except BaseException:
            _cut(request)                           # cancelled, or the door's own fault
            raise
        await response.write_eof()
        return response


async def _answer(request: web.Request, response: web.StreamResponse,
                  content: aiohttp.StreamReader) -> None:
    """Copy tritonserver's answer to the client, each chunk written within
    ``answer_seconds`` (on the doors' clock) of when it came: ``TimeoutError`` past that
    (a client that reads slowly holds the budget no longer than one that reads nothing);
    what broke tritonserver's answer off (``aiohttp.ClientError``) or reading it."""
    clock, seconds = request.app[CLOCK], request.app[ANSWER_SECONDS]
    chunks: asyncio.Queue[tuple[float, bytes | Exception]] = asyncio.Queue(QUEUED_CHUNKS)
    pump = asyncio.get_running_loop().create_task(_pump(content, chunks, clock))
    try:
        while (item := await chunks.get())[1] != b"":
            arrived, chunk = item
            if isinstance(chunk, Exception):
                raise chunk
            await clock.finish_by(arrived + seconds, response.write(chunk))
    finally:
        pump.cancel()


async def _pump(content: aiohttp.StreamReader,
                chunks: asyncio.Queue[tuple[float, bytes | Exception]],
                clock: LoopClock) -> None:
    """tritonserver's answer onto ``chunks`` as (when it came, its bytes), then b"" at its
    end or what broke it off (so the writer never waits on a pump that died)."""
    try:
        async for chunk in content.iter_any():           # never b""
            await chunks.put((clock.now(), chunk))
        end: bytes | Exception = b""
    except Exception as exc:
        end = exc
    await chunks.put((clock.now(), end))


def _cut(request: web.Request) -> None:
    """Reset the client's connection mid-answer, what the kernel still holds for it
    dropped (``SO_LINGER`` 0: a reset, not a FIN after the rest), so it never sees a
    normal end (aiohttp's ``write_eof`` after it fails quietly)."""
    if request.transport is not None:
        sock = request.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        request.transport.abort()


def screen_body(raw_path: str, binary_header: str | None, body: bytes,
                models: frozenset[str]) -> None:
    """Raise :class:`Refused` for a body the door does not forward (module docstring): an
    inference request (on ``raw_path``, not percent-decoded: Triton's view) naming a model
    not in ``models`` (when given), or a JSON part (an ``infer``'s first ``binary_header``
    bytes, else the whole body) of too many strings or values."""
    inference = INFERENCE_PATH.fullmatch(raw_path)
    if inference:
        refuse_unserved(inference[1], models)
    json_part = body
    if inference and inference[2] == "infer" and binary_header is not None:
        length = binary_header.strip()
        if not (length.isascii() and length.isdigit() and int(length) <= len(body)):
            raise Refused(f"{BINARY_HEADER} {binary_header[:20]!r} is not a length within "
                          f"the body's {len(body)} bytes")
        json_part = body[:int(length)]
    strings, values = json_size(json_part, MAX_ENTRIES)
    if strings > MAX_ENTRIES:
        raise Refused(f"the request's JSON has {strings} strings; at most {MAX_ENTRIES} (send "
                      f"a long tensor as binary data, Triton's binary tensor extension)")
    if values > MAX_ENTRIES:
        raise Refused(f"the request's JSON has {values} values; at most {MAX_ENTRIES} (Triton "
                      f"holds each as an object; send a long tensor as binary data, Triton's "
                      f"binary tensor extension)")


def _passed_media_type(content_type: str) -> bool:
    """Whether a ``Content-Type`` goes on to tritonserver: Triton's own (JSON, its binary
    extension's octet stream); any other is dropped, the body forwarded as is, since Triton
    2.51's HTTP server dies on a large ``application/x-www-form-urlencoded`` body (curl's
    ``-d`` default, so a JSON body sent that way still works)."""
    return content_type.split(";", 1)[0].strip().lower() in PASSED_MEDIA_TYPES


async def open_doors(ports: DoorPorts, max_bytes: int, front: FrontConfig,
                    tls: GrpcTLS | None,
                    http_runner: Callable[[web.Application], web.AppRunner],
                    capped: bool = True, models: frozenset[str] = frozenset()
                    ) -> Callable[[], Awaitable[None]]:
    """Start the gRPC door and, with an HTTP pair, the HTTP one (served by
    ``http_runner(app)``, the front's capped runner); returns what stops both.
    ``capped``: the gRPC door runs at most ``front.max_concurrent_requests`` calls (clients'
    doors); else ``PEER_CALLS`` (a context's or generation's, whose callers, the
    deployment's orchestrators, cap their own: a bound on the door's memory); ``models``:
    the repository's, the only ones an inference request through either door may name; the
    doors share the gRPC door's byte budget (so they hold at most its pool plus a reserve
    for each of the gRPC door's calls and the HTTP door's requests)."""
    owner = InnerOwner(tuple(p for p in (ports.inner_grpc_port, ports.inner_http_port)
                             if p is not None))
    grpc_door = GrpcDoor(ports.host, ports.grpc_port, f"{LOOPBACK}:{ports.inner_grpc_port}",
                         max_bytes, front.max_concurrent_requests if capped else None, tls,
                         owner=owner, models=models,
                         max_connections=front.max_connections)
    await grpc_door.start()
    runner = None
    if ports.http_port is not None:
        app = make_http_door(f"{LOOPBACK}:{ports.inner_http_port}", max_bytes,
                             front.max_concurrent_requests, front.body_timeout_seconds, owner,
                             models, grpc_door.budget, grpc_door.clock)
        add_origin_guard(app, front, ports.host)
        runner = http_runner(app)
        await runner.setup()
        await web.TCPSite(runner, ports.host, ports.http_port).start()

    async def close() -> None:
        if runner is not None:
            await runner.cleanup()
        await grpc_door.stop(grace=1.0)
    return close

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
``max_bytes`` in one request. At most ``max_calls`` requests are forwarded at once (429
with ``Retry-After``), over at most ``front.max_connections`` connections; a bodiless ``GET
/v2/health/live`` or ``/ready`` is never refused by the request cap. The door checks
``Origin`` and ``Host`` as the front does (a web page cannot drive it). Nothing is
forwarded unless this user listens on the inner port
(:class:`~triton_disagg.front.public_door.InnerOwner`); an unreachable tritonserver is 502.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable

import aiohttp
from aiohttp import web

from triton_disagg.config.front_section import FrontConfig
from triton_disagg.config.tls_section import GrpcTLS
from triton_disagg.front.http_gates import RETRY_AFTER_SECONDS, add_origin_guard
from triton_disagg.front.openai_api import ApiError
from triton_disagg.front.public_door import UNREACHABLE, GrpcDoor, InnerOwner
from triton_disagg.triton.endpoints import LOOPBACK

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
                        "host", "content-length"})
PASSED_MEDIA_TYPES = frozenset({"application/json", "application/octet-stream"})
CONNECT_SECONDS = 5.0       # to reach tritonserver's HTTP port
PROBES = frozenset({"/v2/health/live", "/v2/health/ready"})   # a bodiless GET: never capped


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
IN_FLIGHT = web.AppKey("in_flight", list)       # [count]: requests being forwarded


def _error(status: int, message: str) -> web.Response:
    """Triton's HTTP error body: ``{"error": "..."}``."""
    return web.json_response({"error": message}, status=status)


def make_http_door(inner: str, max_bytes: int, max_calls: int, body_timeout: float,
                   owner: InnerOwner | None = None) -> web.Application:
    """An aiohttp app forwarding every request to ``http://inner`` (module docstring)."""
    owner = owner or InnerOwner((int(inner.rsplit(":", 1)[1]),))

    async def forward(request: web.Request) -> web.StreamResponse:
        if (request.content_length or 0) > max_bytes:
            return _error(413, f"the body is over {max_bytes} bytes")
        encodings = request.headers.getall("Content-Encoding", [])
        if [e.strip().lower() for e in encodings] not in ([], ["identity"]):
            return _error(415, "a compressed body is not taken (Triton would inflate it "
                               "unbounded); send it as is")
        if not owner.ours():
            return _error(503, f"{UNREACHABLE} (its port is not this server's)")
        probe = request.method == "GET" and request.path in PROBES and not request.body_exists
        if request.app[IN_FLIGHT][0] >= max_calls and not probe:
            busy = _error(429, f"over {max_calls} requests in flight; retry later")
            busy.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
            return busy
        request.app[IN_FLIGHT][0] += 1
        try:
            return await _forward(request, max_bytes, body_timeout)
        finally:
            request.app[IN_FLIGHT][0] -= 1

    async def open_session(app: web.Application) -> None:
        app[SESSION] = aiohttp.ClientSession(
            auto_decompress=False, timeout=aiohttp.ClientTimeout(sock_connect=CONNECT_SECONDS))

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

    app = web.Application(client_max_size=max_bytes, middlewares=[triton_errors])
    app[INNER], app[IN_FLIGHT] = inner, [0]
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_route("*", "/{path:.*}", forward)
    return app


async def _forward(request: web.Request, max_bytes: int,
                   body_timeout: float) -> web.StreamResponse:
    try:
        async with asyncio.timeout(body_timeout):
            body = await request.read()         # at most client_max_size, else 413
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"the body is over {max_bytes} bytes")
    except TimeoutError:
        return _error(408, f"the body did not arrive within {body_timeout:g} s")
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
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


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
    doors); else no cap (a context's or generation's, whose callers, the deployment's
    orchestrators, cap their own); ``models``: the repository's, the only ones an inference
    request through the gRPC door may name."""
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
                             front.max_concurrent_requests, front.body_timeout_seconds, owner)
        add_origin_guard(app, front, ports.host)
        runner = http_runner(app)
        await runner.setup()
        await web.TCPSite(runner, ports.host, ports.http_port).start()

    async def close() -> None:
        if runner is not None:
            await runner.cleanup()
        await grpc_door.stop(grace=1.0)
    return close

"""The public door: Triton's gRPC and HTTP ports of ``serve all`` and ``serve scheduler``,
answered in the HTTP front's process (:mod:`.http_front`) and forwarded to tritonserver,
which listens on loopback on ports of its own (:func:`launch.deploy.behind_door`).

Why: Triton 2.51 takes any message up to 2 GiB on either port and holds several copies
of it while a model refuses it; it has no size bound of its own. The door bounds what
reaches it, with grpcio's and aiohttp's own machinery, not a protocol of ours.

gRPC (``grpc.aio``): every method of ``inference.GRPCInferenceService`` (tritonclient's
service descriptor names them, with their streaming kind) is forwarded as raw bytes, never
parsed: request metadata (request ids and the like; not the transport's own
``grpc-*``, ``user-agent``, ``content-type``, ``te``) and the deadline go with it; the
status, details and trailing metadata come back unchanged; a client that cancels (or
disconnects) cancels the call to tritonserver. HTTP (aiohttp): method, path and query as
sent, headers less the hop-by-hop ones, and the body are forwarded; the answer streams
back as it comes (Triton's ``generate_stream`` events included).

Invariants: a gRPC message over ``max_bytes`` is refused by grpcio from its length prefix
(RESOURCE_EXHAUSTED) before it is read; an HTTP body over ``max_bytes`` is refused (413)
from its ``Content-Length`` before it is read, or, chunked, once ``max_bytes`` have come;
a body slower than ``body_timeout`` is 408; a ``Content-Type`` other than Triton's (JSON,
octet stream) is not forwarded (a large form body kills Triton 2.51's HTTP server); a
compressed HTTP body (``Content-Encoding``)
is 415, since Triton would inflate it unbounded (grpcio bounds an inflated gRPC message
itself); so tritonserver never receives more than ``max_bytes`` in one message. At most
``max_calls`` gRPC calls run at once (grpcio refuses more with RESOURCE_EXHAUSTED) and
``max_calls`` HTTP requests (429 with ``Retry-After``), over at most
``front.max_connections`` HTTP connections; a bodiless ``GET /v2/health/live`` or
``/ready`` is never refused by the request cap. Every gRPC call, unary ones included (all
are served as streams), with no message either way for ``idle_seconds``
(``STREAM_IDLE_SECONDS``, Envoy's stream idle timeout) is ended (DEADLINE_EXCEEDED) and a
gRPC connection with no call for as long is closed, so idle clients cannot hold the call
cap or the process's descriptors for ever; past ``front.max_connections`` gRPC connections
a new one is closed at once. The HTTP door checks ``Origin`` and ``Host`` as the front
does (a web page cannot drive it). With ``tls`` (the config's ``grpc_tls``) the public
gRPC port speaks TLS (mutual: clients need a certificate); the hop to tritonserver is
plain, on loopback. Nothing is forwarded unless a socket of this user listens on 127.0.0.1
on each inner port (:class:`InnerOwner`): a port another local user took first (it is on
tritonserver's command line) gets no prompt. An unreachable tritonserver is UNAVAILABLE
(gRPC, its details not naming the inner port) or 502 (HTTP).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
import grpc
from aiohttp import web

from triton_disagg.config.front_section import FrontConfig
from triton_disagg.config.tls_section import GrpcTLS
from triton_disagg.front.http_gates import RETRY_AFTER_SECONDS, add_origin_guard
from triton_disagg.front.openai_api import ApiError
from triton_disagg.triton.tritonserver import KEEPALIVE_MS, LOOPBACK

SERVICE = "inference.GRPCInferenceService"
DROPPED_METADATA = frozenset({"user-agent", "content-type", "te", "host"})  # and grpc-*, :*
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
                        "host", "content-length"})
PASSED_MEDIA_TYPES = frozenset({"application/json", "application/octet-stream"})
CONNECT_SECONDS = 5.0       # to reach tritonserver's HTTP port
PROBES = frozenset({"/v2/health/live", "/v2/health/ready"})   # a bodiless GET: never capped
OWNER_CHECK_SECONDS = 1.0   # how long an inner port's owner check is trusted
STREAM_IDLE_SECONDS = 300.0  # a gRPC call with no message either way this long ends (Envoy's)
UNREACHABLE = "tritonserver is not reachable"
# 127.0.0.1 as /proc/net/tcp writes it, and as tcp6 writes ::ffff:127.0.0.1 (how grpc core
# binds "127.0.0.1" where IPv6 is up)
LOOPBACK_HEX = {"/proc/net/tcp": "0100007F", "/proc/net/tcp6": "0000000000000000FFFF00000100007F"}


class InnerOwner:
    """Whether a socket of this process's user listens on 127.0.0.1 (or ::ffff:127.0.0.1) on
    each inner port, from ``/proc/net/tcp`` and ``tcp6``. Linux gives a connection to
    127.0.0.1:P to that exact listener before any wildcard one, and while it listens no
    other user can bind 127.0.0.1:P (nor join it: SO_REUSEPORT is shared within one
    uid), so then the port is tritonserver's; listeners of others elsewhere (0.0.0.0,
    ::, 127.0.0.2) take none of the door's connections and are ignored. Asked at most
    once a ``OWNER_CHECK_SECONDS``."""

    def __init__(self, ports: tuple[int, ...]):
        self.ports, self.uid = ports, os.geteuid()
        self._checked, self._ours = -OWNER_CHECK_SECONDS, False

    def ours(self) -> bool:
        now = time.monotonic()
        if now - self._checked >= OWNER_CHECK_SECONDS:
            self._checked, self._ours = now, self._check()
        return self._ours

    def _check(self) -> bool:
        mine: set[int] = set()
        for table, loopback in LOOPBACK_HEX.items():
            try:
                rows = Path(table).read_text().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                fields = row.split()        # sl local rem st ... uid (7)
                address, port_hex = fields[1].rsplit(":", 1)
                if (fields[3] == "0A" and address == loopback      # 0A: LISTEN
                        and int(fields[7]) == self.uid):
                    mine.add(int(port_hex, 16))
        return set(self.ports) <= mine


@dataclass(frozen=True)
class DoorPorts:
    """Where the door listens (``host``, the public ports) and where tritonserver does
    (loopback, ``inner_*``); an HTTP pair of None: no HTTP door."""

    host: str
    grpc_port: int
    inner_grpc_port: int
    http_port: int | None = None
    inner_http_port: int | None = None


def service_methods() -> dict[str, tuple[bool, bool]]:
    """Every method of Triton's gRPC service: name -> (client streams, server streams)."""
    from tritonclient.grpc import service_pb2

    service = service_pb2.DESCRIPTOR.services_by_name[SERVICE.rsplit(".", 1)[1]]
    return {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}


def forwarded_metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str | bytes], ...]:
    """The caller's metadata less what the transport sets itself."""
    return tuple((key, value) for key, value in context.invocation_metadata() or ()
                 if key not in DROPPED_METADATA and not key.startswith((":", "grpc-")))


async def _relay_failure(context: grpc.aio.ServicerContext, exc: grpc.aio.AioRpcError) -> None:
    """End the caller's call as tritonserver ended ours (raises grpc's AbortError); a
    failure to reach it is said without its address."""
    details = exc.details() or ""
    if exc.code() is grpc.StatusCode.UNAVAILABLE and LOOPBACK in details:
        details = UNREACHABLE
    await context.abort(exc.code(), details, exc.trailing_metadata() or ())


class GrpcDoor:
    """A ``grpc.aio`` server on ``host:port`` forwarding Triton's service to ``inner``."""

    def __init__(self, host: str, port: int, inner: str, max_bytes: int, max_calls: int,
                 tls: GrpcTLS | None = None, idle_seconds: float = STREAM_IDLE_SECONDS,
                 owner: InnerOwner | None = None, max_connections: int = 512):
        self.address, self.inner, self.idle_seconds = f"{host}:{port}", inner, idle_seconds
        self.owner = owner or InnerOwner((int(inner.rsplit(":", 1)[1]),))
        self.server = grpc.aio.server(maximum_concurrent_rpcs=max_calls, options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.keepalive_permit_without_calls", 1),       # as tritonserver allows
            ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
            ("grpc.max_connection_idle_ms", int(idle_seconds * 1000)),
            ("grpc.max_allowed_incoming_connections", max_connections),   # more: closed
            ("grpc.so_reuseport", 0)])     # a port taken is an error, never shared
        self.channel = grpc.aio.insecure_channel(inner, options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
        handlers = {name: self._handler(name, *kind) for name, kind in service_methods().items()}
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE, handlers)])
        if tls is None:
            self.server.add_insecure_port(self.address)
        else:
            self.server.add_secure_port(self.address, _server_credentials(tls))

    def _handler(self, name: str, client_streams: bool,
                 server_streams: bool) -> grpc.RpcMethodHandler:
        """Every method is served as a stream (the wire is the same), so its handler, and
        the idle watch, start when the call does: a unary handler would wait for its one
        message, without a deadline, holding a place under the call cap."""
        path = f"/{SERVICE}/{name}"
        if client_streams and server_streams:
            return grpc.stream_stream_rpc_method_handler(self._streams(path))
        if client_streams or server_streams:
            raise ValueError(f"{path}: a streaming kind the door does not forward")
        return grpc.stream_stream_rpc_method_handler(self._unary(path))

    def _unary(self, path: str) -> Callable[..., AsyncIterator[bytes]]:
        method = self.channel.unary_unary(path)     # no (de)serializer: bytes as they come

        async def forward(requests: AsyncIterator[bytes],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            await self._check_owner(context)
            try:
                async with asyncio.timeout(self.idle_seconds):
                    request = await anext(aiter(requests), None)
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no request within {self.idle_seconds:g} s")
            if request is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
            call = method(request, metadata=forwarded_metadata(context),
                          timeout=context.time_remaining())
            try:
                response = await call
            except grpc.aio.AioRpcError as exc:
                await _relay_failure(context, exc)
            finally:
                call.cancel()                      # no-op once done; else the caller left
            context.set_trailing_metadata(await call.trailing_metadata() or ())
            yield response
        return forward

    def _streams(self, path: str) -> Callable[..., AsyncIterator[bytes]]:
        method = self.channel.stream_stream(path)

        async def forward(requests: AsyncIterator[bytes],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            await self._check_owner(context)
            last = [time.monotonic()]              # a message either way

            async def counted() -> AsyncIterator[bytes]:
                async for request in requests:
                    last[0] = time.monotonic()
                    yield request

            call = method(counted(), metadata=forwarded_metadata(context),
                          timeout=context.time_remaining())
            idle = asyncio.get_running_loop().create_task(self._idle_watch(call, last))
            try:
                async for response in call:
                    last[0] = time.monotonic()
                    yield response
                context.set_trailing_metadata(await call.trailing_metadata() or ())
            except grpc.aio.AioRpcError as exc:
                await _relay_failure(context, exc)
            except asyncio.CancelledError:
                if not idle.done() or idle.result() is not True:
                    raise                          # the caller cancelled or left
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no message either way for {self.idle_seconds:g} s")
            finally:
                idle.cancel()
                call.cancel()                      # the caller cancelled or left: so do we
        return forward

    async def _idle_watch(self, call: grpc.aio.StreamStreamCall, last: list[float]) -> bool:
        """Cancel ``call`` once no message has passed for ``idle_seconds``; True then."""
        while True:
            left = last[0] + self.idle_seconds - time.monotonic()
            if left <= 0:
                call.cancel()
                return True
            await asyncio.sleep(left)

    async def _check_owner(self, context: grpc.aio.ServicerContext) -> None:
        if not self.owner.ours():
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"{UNREACHABLE} (its port is not this server's)")

    async def start(self) -> None:
        await self.server.start()

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)
        await self.channel.close()


def _server_credentials(tls: GrpcTLS) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())],
        root_certificates=Path(tls.ca_file).read_bytes(), require_client_auth=tls.mutual)


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


async def open_door(ports: DoorPorts, max_bytes: int, front: FrontConfig,
                    tls: GrpcTLS | None,
                    http_runner: Callable[[web.Application], web.AppRunner]
                    ) -> Callable[[], Awaitable[None]]:
    """Start the gRPC door and, with an HTTP pair, the HTTP one (served by
    ``http_runner(app)``, the front's capped runner); returns what stops both."""
    owner = InnerOwner(tuple(p for p in (ports.inner_grpc_port, ports.inner_http_port)
                             if p is not None))
    grpc_door = GrpcDoor(ports.host, ports.grpc_port, f"{LOOPBACK}:{ports.inner_grpc_port}",
                         max_bytes, front.max_concurrent_requests, tls, owner=owner,
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

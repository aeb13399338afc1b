"""The public door: Triton's gRPC and HTTP ports of ``serve all`` and ``serve scheduler``,
answered in the HTTP front's process (:mod:`.http_front`) and forwarded to tritonserver,
which listens on loopback on ports of its own (:func:`launch.deploy.behind_door`).

Why: Triton 2.51 takes any message up to 2 GiB on either port and holds several copies
of it while a model refuses it; it has no size bound of its own. The door bounds what
reaches it, with grpcio's and aiohttp's own machinery, not a protocol of ours.

gRPC (``grpc.aio``): every method of ``inference.GRPCInferenceService`` (tritonclient's
service descriptor names them, with their streaming kind) is forwarded as raw bytes, never
parsed: request metadata (the restricted-API header, request ids; not the transport's own
``grpc-*``, ``user-agent``, ``content-type``, ``te``) and the deadline go with it; the
status, details and trailing metadata come back unchanged; a client that cancels (or
disconnects) cancels the call to tritonserver. HTTP (aiohttp): method, path and query as
sent, headers less the hop-by-hop ones, and the body are forwarded; the answer streams
back as it comes (Triton's ``generate_stream`` events included).

Invariants: a gRPC message over ``max_bytes`` is refused by grpcio from its length prefix
(RESOURCE_EXHAUSTED) before it is read; an HTTP body over ``max_bytes`` is refused (413)
from its ``Content-Length`` before it is read, or, chunked, once ``max_bytes`` have come;
a body slower than ``body_timeout`` is 408; a compressed HTTP body (``Content-Encoding``) is
415, since Triton would inflate it unbounded (grpcio bounds an inflated gRPC message
itself); so tritonserver never receives more than ``max_bytes`` in one message. At most
``max_calls`` gRPC calls run at once (grpcio refuses more with RESOURCE_EXHAUSTED) and
``max_calls`` HTTP requests (429), over at most ``front.max_connections`` HTTP
connections. With ``tls`` (the config's ``grpc_tls``) the public gRPC port speaks TLS
(mutual: clients need a certificate); the hop to tritonserver is plain, on loopback. An
unreachable tritonserver is UNAVAILABLE (gRPC) or 502 (HTTP).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
import grpc
from aiohttp import web

from triton_disagg.config.front_section import FrontConfig
from triton_disagg.config.tls_section import GrpcTLS
from triton_disagg.triton.tritonserver import KEEPALIVE_MS

SERVICE = "inference.GRPCInferenceService"
LOOPBACK = "127.0.0.1"
DROPPED_METADATA = frozenset({"user-agent", "content-type", "te", "host"})  # and grpc-*, :*
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
                        "host", "content-length"})
CONNECT_SECONDS = 5.0       # to reach tritonserver's HTTP port


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
    """End the caller's call as tritonserver ended ours (raises grpc's AbortError)."""
    await context.abort(exc.code(), exc.details() or "", exc.trailing_metadata() or ())


class GrpcDoor:
    """A ``grpc.aio`` server on ``host:port`` forwarding Triton's service to ``inner``."""

    def __init__(self, host: str, port: int, inner: str, max_bytes: int, max_calls: int,
                 tls: GrpcTLS | None = None):
        self.address, self.inner = f"{host}:{port}", inner
        self.server = grpc.aio.server(maximum_concurrent_rpcs=max_calls, options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.keepalive_permit_without_calls", 1),       # as tritonserver allows
            ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
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
        path = f"/{SERVICE}/{name}"
        if client_streams and server_streams:
            return grpc.stream_stream_rpc_method_handler(self._streams(path))
        if client_streams or server_streams:
            raise ValueError(f"{path}: a streaming kind the door does not forward")
        return grpc.unary_unary_rpc_method_handler(self._unary(path))

    def _unary(self, path: str) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]:
        method = self.channel.unary_unary(path)     # no (de)serializer: bytes as they come

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            call = method(request, metadata=forwarded_metadata(context),
                          timeout=context.time_remaining())
            try:
                response = await call
            except grpc.aio.AioRpcError as exc:
                await _relay_failure(context, exc)
            finally:
                call.cancel()                      # no-op once done; else the caller left
            context.set_trailing_metadata(await call.trailing_metadata() or ())
            return response
        return forward

    def _streams(self, path: str) -> Callable[..., AsyncIterator[bytes]]:
        method = self.channel.stream_stream(path)

        async def forward(requests: AsyncIterator[bytes],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            call = method(requests, metadata=forwarded_metadata(context),
                          timeout=context.time_remaining())
            try:
                async for response in call:
                    yield response
                context.set_trailing_metadata(await call.trailing_metadata() or ())
            except grpc.aio.AioRpcError as exc:
                await _relay_failure(context, exc)
            finally:
                call.cancel()                      # the caller cancelled or left: so do we
        return forward

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


def make_http_door(inner: str, max_bytes: int, max_calls: int,
                   body_timeout: float) -> web.Application:
    """An aiohttp app forwarding every request to ``http://inner`` (module docstring)."""

    async def forward(request: web.Request) -> web.StreamResponse:
        if (request.content_length or 0) > max_bytes:
            return _error(413, f"the body is over {max_bytes} bytes")
        if request.headers.get("Content-Encoding", "identity").lower() != "identity":
            return _error(415, "a compressed body is not taken (Triton would inflate it "
                               "unbounded); send it as is")
        if request.app[IN_FLIGHT][0] >= max_calls:
            return _error(429, f"over {max_calls} requests in flight; retry later")
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

    app = web.Application(client_max_size=max_bytes)
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
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
    url = f"http://{request.app[INNER]}{request.rel_url.raw_path_qs}"   # origin-form only
    try:
        upstream = await request.app[SESSION].request(
            request.method, url, headers=headers, data=body or None, allow_redirects=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"))
    except aiohttp.ClientError:
        return _error(502, "tritonserver is not reachable")
    async with upstream:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        response.headers.extend((k, v) for k, v in upstream.headers.items()
                                if k.lower() not in HOP_BY_HOP - {"content-length"})
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def open_door(ports: DoorPorts, max_bytes: int, front: FrontConfig,
                    tls: GrpcTLS | None,
                    http_runner: Callable[[web.Application], web.AppRunner]
                    ) -> Callable[[], Awaitable[None]]:
    """Start the gRPC door and, with an HTTP pair, the HTTP one (served by
    ``http_runner(app)``, the front's capped runner); returns what stops both."""
    grpc_door = GrpcDoor(ports.host, ports.grpc_port, f"{LOOPBACK}:{ports.inner_grpc_port}",
                         max_bytes, front.max_concurrent_requests, tls)
    await grpc_door.start()
    runner = None
    if ports.http_port is not None:
        runner = http_runner(make_http_door(f"{LOOPBACK}:{ports.inner_http_port}", max_bytes,
                                            front.max_concurrent_requests,
                                            front.body_timeout_seconds))
        await runner.setup()
        await web.TCPSite(runner, ports.host, ports.http_port).start()

    async def close() -> None:
        if runner is not None:
            await runner.cleanup()
        await grpc_door.stop(grace=1.0)
    return close

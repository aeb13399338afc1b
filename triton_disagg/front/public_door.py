"""The public door: Triton's gRPC port of every role (``serve all|scheduler``: the
clients'; ``serve context|generation``: their peers'), answered in the HTTP front's process
(:mod:`.http_front`) and forwarded to tritonserver, which listens on loopback on ports of
its own (:func:`launch.deploy.behind_door`); its HTTP port is :mod:`.http_door`'s, and both
doors are opened by :func:`.http_door.open_doors`.

Why: Triton 2.51 takes any message up to 2 GiB on either port and holds several copies
of it while a model refuses it (on context and generation, before the model checks the
peer credential); it has no size bound of its own. The door bounds what
reaches it, with grpcio's own machinery, not a protocol of ours.

gRPC (``grpc.aio``): every method of ``inference.GRPCInferenceService`` (tritonclient's
service descriptor names them, with their streaming kind) is forwarded as raw bytes:
request metadata (request ids and the like; not the transport's own ``grpc-*``,
``user-agent``, ``content-type``, ``te``) and the deadline go with it; the status, details
and trailing metadata come back unchanged (a stream ends OK once the client half-closed and
every inner stream ended OK, else as the first that failed); a client that cancels (or
disconnects) cancels the calls to tritonserver.

Invariants: a message over ``max_bytes`` is refused by grpcio from its length prefix
(RESOURCE_EXHAUSTED) before it is read (grpcio bounds an inflated message itself), so
tritonserver never receives more than ``max_bytes`` in one message. An inference request
(``ModelInfer``: INVALID_ARGUMENT; a ``ModelStreamInfer`` message: answered in the stream
with its ``error_message``, as Triton answers a bad request, the stream going on) is refused past
``MAX_ENTRIES`` strings, tensors and parameters or ``MAX_NUMBERS`` numbers, or naming a
model not served (:class:`MessageScreen`): Triton's protobuf holds each entry as an object,
tens of bytes for a one-byte entry, for as long as the request lives (a 10 MiB message of
empty strings took ~200 MB); every message of every method goes on as parsed with
tritonclient's protobuf types, without fields they do not know (Triton would keep those
too). Each message of a client's stream is its own inner stream to tritonserver
(:class:`.door_relay.StreamRelay`), so Triton never writes two requests' answers on one stream. A
request message holds its bytes (at least ``MESSAGE_FLOOR``) until Triton ends its
request (its unary call or inner stream), of its call's reserve first (``call_reserve``
bytes a call, never waiting for others': a small request is never held up by large ones),
the rest of a pool of at most ``max_outstanding`` bytes door-wide (:class:`ByteBudget`: the
door holds at most the pool plus its calls' reserves); a message past the pool waits, so a
client cannot queue Triton gigabytes (a stream of 24 such messages took 4.7 GB; a unary
call waits at most ``idle_seconds``, then RESOURCE_EXHAUSTED), a client's stream has at
most ``STREAM_CALLS`` messages at tritonserver (its next message is read when one ends),
and a client that takes no response
for ``write_seconds``, or one ``answer_seconds`` after tritonserver gave it, is ended and
gives its bytes back (both timed on the doors' :class:`LoopClock`: the door's own stalls do
not count against a client); a message other than an inference
request (health, metadata) of at most ``MESSAGE_FLOOR`` bytes holds none and never waits.
At most ``max_calls`` calls run at once (None: ``PEER_CALLS``, a peers' door, whose
callers cap their own), ``CONNECTION_STREAMS`` on one connection; a call past the cap
ends a call that holds its place doing nothing (one that never did work first, then the
one idle longest, past a grace: UNAVAILABLE, "call again") or, none such, is refused
(RESOURCE_EXHAUSTED; :class:`.call_seats.Roster`), so such calls never keep a working
one out. Every call, unary ones included (all are served as streams), with no message either
way for ``idle_seconds`` (``STREAM_IDLE_SECONDS``, Envoy's stream idle timeout) is ended
(DEADLINE_EXCEEDED); a connection that has not spoken HTTP/2 within ``HANDSHAKE_SECONDS``
or has had no call for ``CONNECTION_IDLE_SECONDS`` is closed (a client reconnects). The
public port is :class:`.grpc_admission.ConnectionGate`'s: at most ``front.max_connections``
connections, each piped to the door's grpc server on a loopback port of its own; one past
the cap takes the place of a connection none of whose calls works (one that never worked
first, then the one idle longest, past a grace) or, none such, is closed at once, so idle or
reconnecting clients cannot hold the process's descriptors or keep a working one out.
With ``tls`` (the config's ``grpc_tls``) the door speaks TLS
through the gate (mutual: clients need a certificate); the hop to tritonserver is plain, on
loopback.
Nothing is forwarded unless a socket of this user listens on 127.0.0.1 on each inner port
(:class:`InnerOwner`): a port another local user took first (it is on tritonserver's
command line) gets no prompt. An unreachable tritonserver is UNAVAILABLE (its details not
naming the inner port).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, Sequence

import grpc
from google.protobuf.descriptor import MethodDescriptor

from triton_disagg.config.tls_section import GrpcTLS
from triton_disagg.front.door_guards import (CALL_RESERVE, CLIENT_SECONDS, MESSAGE_FLOOR,
                                             OUTSTANDING_MESSAGES, UNREACHABLE, BudgetFull,
                                             ByteBudget, InnerOwner, LoopClock, MessageScreen,
                                             Refused, message_cost)
from triton_disagg.front.door_relay import (EVICTED, Ending, RelayLimits, StreamRelay,
                                            forwarded_metadata, write_within)
from triton_disagg.front.call_seats import MAX_DETACHED, Roster, Seat, worked_rank
from triton_disagg.front.grpc_admission import HANDSHAKE_SECONDS, ConnectionGate
from triton_disagg.triton.endpoints import LOOPBACK
from triton_disagg.triton.tritonserver import KEEPALIVE_MS

SERVICE = "inference.GRPCInferenceService"
STREAM_IDLE_SECONDS = 300.0  # a gRPC call with no message either way this long ends (Envoy's)
INFER_METHODS = frozenset({"ModelInfer", "ModelStreamInfer"})   # their messages: checked
PEER_CALLS = 4096           # calls at once through a peers' door (~22 KB of the door's each)
PEER_RESERVE = MESSAGE_FLOOR   # a peers' call's bytes that never wait (4096 calls: 64 MiB)
CONNECTION_STREAMS = 256    # HTTP/2 streams at once on one connection (a client queues more)
CONNECTION_IDLE_SECONDS = 30.0   # one with no call this long is closed (clients reconnect)


def service_methods() -> Sequence[MethodDescriptor]:
    """Every method of Triton's gRPC service, as tritonclient's descriptor names it (name,
    streaming kind, request type)."""
    from tritonclient.grpc import service_pb2

    return service_pb2.DESCRIPTOR.services_by_name[SERVICE.rsplit(".", 1)[1]].methods


def screens(models: frozenset[str] = frozenset()) -> dict[str, MessageScreen]:
    """Every method of Triton's gRPC service -> the screen of its request messages."""
    from tritonclient.grpc import service_pb2

    return {m.name: MessageScreen(getattr(service_pb2, m.input_type.name),
                                  m.name in INFER_METHODS, models) for m in service_methods()}


class GrpcDoor:
    """A ``grpc.aio`` server on ``host:port`` forwarding Triton's service to ``inner``;
    ``max_calls`` None: ``PEER_CALLS`` (a peers' door, whose callers cap their own);
    ``call_reserve`` None: ``CALL_RESERVE`` a call, ``PEER_RESERVE`` on a peers' door (so it
    holds at most ``max_outstanding`` + ``max_calls`` x ``call_reserve`` bytes of requests,
    plus its HTTP door's requests' reserves)."""

    def __init__(self, host: str, port: int, inner: str, max_bytes: int, max_calls: int | None,
                 tls: GrpcTLS | None = None, idle_seconds: float = STREAM_IDLE_SECONDS,
                 owner: InnerOwner | None = None, max_connections: int = 512,
                 max_outstanding: int | None = None, models: frozenset[str] = frozenset(),
                 write_seconds: float = CLIENT_SECONDS, answer_seconds: float = CLIENT_SECONDS,
                 call_reserve: int | None = None):
        self.address, self.inner = f"{host}:{port}", inner
        self.limits = RelayLimits(max_bytes, idle_seconds, write_seconds, answer_seconds)
        self.budget = ByteBudget(max_outstanding or OUTSTANDING_MESSAGES * max_bytes,
                                 (CALL_RESERVE if max_calls else PEER_RESERVE)
                                 if call_reserve is None else call_reserve)
        self.clock = LoopClock()
        self.owner = owner or InnerOwner((int(inner.rsplit(":", 1)[1]),))
        self.roster = Roster(max_calls or PEER_CALLS)
        # grpcio's cap: the seated calls, calls refused a seat, calls ended mid-answer still writing
        rpcs = 2 * self.roster.limit + MAX_DETACHED * max_connections
        self.server = grpc.aio.server(maximum_concurrent_rpcs=rpcs, options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_concurrent_streams", CONNECTION_STREAMS),
            ("grpc.keepalive_permit_without_calls", 1),       # as tritonserver allows
            ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
            ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_SECONDS * 1000)),
            ("grpc.max_connection_idle_ms",
             int(min(idle_seconds, CONNECTION_IDLE_SECONDS) * 1000)),
            ("grpc.http2.bdp_probe", 0),   # else a stream's window grows to megabytes the
                                           # door buffers unread (8 streams: 3 GB)
            # the gate's connections fit, and ones it ended that grpc has yet to reap (a
            # reconnect flood ends thousands a second); past: closed (ones made straight
            # to the inner port, not through the gate)
            ("grpc.max_allowed_incoming_connections", 4 * max_connections + 256),
            ("grpc.so_reuseport", 0)])     # a port taken is an error, never shared
        self.channel = grpc.aio.insecure_channel(inner, options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
        self.screens = screens(models)
        handlers = {m.name: self._handler(m.name, m.client_streaming, m.server_streaming)
                    for m in service_methods()}
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE, handlers)])
        own = f"{LOOPBACK}:0"                 # the grpc server's port, behind the gate
        inner_port = self.server.add_insecure_port(own) if tls is None else \
            self.server.add_secure_port(own, _server_credentials(tls))
        self.gate = ConnectionGate(host, port, inner_port, max_connections, self.clock)

    def _handler(self, name: str, client_streams: bool,
                 server_streams: bool) -> grpc.RpcMethodHandler:
        """Every method is served as a stream (the wire is the same), so its handler, and
        the idle watch, start when the call does: a unary handler would wait for its one
        message, without a deadline, holding a place under the call cap."""
        path, screen = f"/{SERVICE}/{name}", self.screens[name]
        if client_streams and server_streams:
            return grpc.stream_stream_rpc_method_handler(self._streams(path, screen))
        if client_streams or server_streams:
            raise ValueError(f"{path}: a streaming kind the door does not forward")
        return grpc.stream_stream_rpc_method_handler(self._unary(path, screen))

    def _unary(self, path: str, screen: MessageScreen) -> Callable[..., Awaitable[None]]:
        method = self.channel.unary_unary(path)     # no (de)serializer: bytes as they come

        async def forward(requests: AsyncIterator[bytes],
                          context: grpc.aio.ServicerContext) -> None:
            await self._seated(context, lambda seat: serve(requests, context, seat))

        async def serve(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext,
                        seat: Seat) -> None:
            try:
                async with asyncio.timeout(self.limits.idle_seconds):
                    request = await anext(aiter(requests), None)
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no request within {self.limits.idle_seconds:g} s")
            if request is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
            try:
                request = screen(request)
            except Refused as refused:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(refused))
            await self._answer(method, request, context, seat, screen.infer)
        return forward

    async def _answer(self, method: grpc.aio.UnaryUnaryMultiCallable, request: bytes,
                      context: grpc.aio.ServicerContext, seat: Seat, infer: bool) -> None:
        """Relay one unary call, its bytes held until its response is written (or not). Its
        seat is at work (never ended for room) while it is at tritonserver, not while it
        waits for the budget nor while its response waits for the client: an answered inference
        then ranks as work done (:func:`.call_seats.worked_rank`), any other answer as
        none, so a client that reads nothing holds no seat."""
        try:
            taken = await self.budget.take_within(message_cost(request, infer),
                                                  self.limits.idle_seconds,
                                                  self.budget.reserve())
        except BudgetFull as full:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(full))
        seat.rank = at_work = lambda: None         # at tritonserver
        call = method(request, metadata=forwarded_metadata(context),
                      timeout=context.time_remaining())
        try:
            response = await call
            context.set_trailing_metadata(await call.trailing_metadata() or ())
            answered = self.clock.now()
            seat.rank = (lambda: worked_rank(answered, self.clock.now())) if infer \
                else seat.unworked
            await write_within(context, response, self.limits.write_seconds, self.clock, seat)
            return
        except grpc.aio.AioRpcError as exc:
            ending = Ending.relayed(exc)
        except Ending as failed:
            ending = failed
        finally:
            call.cancel()                          # no-op once done; else the caller left
            self.budget.give(taken)
            if seat.rank is at_work:               # ended unanswered: no work done
                seat.rank = seat.unworked
        await context.abort(*ending.args)

    def _streams(self, path: str, screen: MessageScreen) -> Callable[..., Awaitable[None]]:
        method = self.channel.stream_stream(path)

        async def forward(requests: AsyncIterator[bytes],
                          context: grpc.aio.ServicerContext) -> None:
            async def serve(seat: Seat) -> None:
                relay = StreamRelay(self.budget, self.clock, self.limits, method, screen,
                                    context, seat)
                seat.rank, seat.stop_work = relay.rank, relay.stop_work
                await relay.run(requests)
            await self._seated(context, serve)
        return forward

    async def _seated(self, context: grpc.aio.ServicerContext,
                      serve: Callable[[Seat], Awaitable[None]]) -> None:
        """``serve`` the call in a seat of :attr:`roster` (refused without one), ended
        UNAVAILABLE when the roster takes the seat back for another call (one writing an
        answer then: once that is written, :class:`.call_seats.Seat`). A call whose
        client did not take an answer in time (``seat.unread``) ends its connection too: the
        status would wait behind that answer, and grpcio counts the call against
        ``maximum_concurrent_rpcs`` for as long as its connection lives (64 such calls
        every 10 s had filled it)."""
        if not await self.owner.ours():
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"{UNREACHABLE} (its port is not this server's)")
        seat = Seat(self.clock.now())
        if not self.roster.enter(seat):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"over {self.roster.limit} calls at once, none idle; retry "
                                f"later")
        connection = self.gate.connection(context.peer())
        if connection is not None:
            connection.seated(seat)
        try:
            await serve(seat)
        except asyncio.CancelledError:
            if seat.evicted:
                await context.abort(grpc.StatusCode.UNAVAILABLE, EVICTED)
            raise
        finally:
            self.roster.leave(seat)
            if connection is not None:
                connection.unseated(seat)
                if seat.unread:
                    connection.end()

    async def start(self) -> None:
        self.clock.start()
        await self.server.start()
        await self.gate.start()

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)
        await self.gate.stop()
        await self.channel.close()
        await self.clock.stop()


def _server_credentials(tls: GrpcTLS) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())],
        root_certificates=Path(tls.ca_file).read_bytes(), require_client_auth=tls.mutual)

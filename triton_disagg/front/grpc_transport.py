"""The orchestrator's gRPC transport (``serve scheduler``): tritonclient calls to the context
and generation servers its routers pick (what both transports share: :mod:`.engine_calls`).

Over gRPC each call goes to the server its role's
:class:`~triton_disagg.routing.router.Router` picks, through one ``tritonclient.grpc.aio`` client per url (made on first use; closed
once its server has left the pool and no call uses it). A context server that fails
before it answers (UNAVAILABLE: refused, reset, unreachable; DEADLINE_EXCEEDED) is tried
once more on another context server: a context call has no effect but KV that its lease
reclaims. When every context server tried let its deadline pass, the request fails with
:class:`~triton_disagg.errors.Timeout` (504 at the HTTP front), else with
:class:`~triton_disagg.errors.Unavailable` (503). A generation server that does not answer, or whose request's token stream
went silent and which then fails a liveness probe (``is_server_live`` within
``PROBE_TIMEOUT_SECONDS``), is lost: :class:`GenerationLost` makes the orchestrator
migrate the request under a new id on a route that avoids it (a server that did accept
it after all streams to an id nobody waits for). Failures reach the client as one line
naming the role and the url(s) tried, and the router passes that server over for a while
(:meth:`~triton_disagg.routing.router.Router.unanswered`).

gRPC channels send keepalive pings (``KEEPALIVE_MS``, answered within
``KEEPALIVE_TIMEOUT_MS``), so a connection to a server that stopped answering fails its
calls without waiting for their deadlines.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

import numpy as np

from triton_disagg import protocol as P
from triton_disagg.config.tls_section import GrpcTLS
from triton_disagg.errors import (ErrorCode, GenerationLost, NoServer, Timeout, Unavailable,
                                  from_grpc_status)
from triton_disagg.engine.sequence import EngineRequest
from triton_disagg.front.token_inbox import GenerationAnswer
from triton_disagg.front.engine_calls import (CALL_SPECS, CALL_TIMEOUT_SECONDS,
                                            RELEASE_TIMEOUT_SECONDS, call_inputs,
                                            call_parameters, callee_error, generation_answer,
                                            microseconds, unbatch)
from triton_disagg.routing.router import Router
from triton_disagg.triton.grpc_channel import client_options
from triton_disagg.triton.tensors import by_name, peer_credential, to_batched

if TYPE_CHECKING:
    from tritonclient.grpc.aio import InferenceServerClient
from triton_disagg.triton.tritonserver import KEEPALIVE_MS

DEADLINE_EXCEEDED = "StatusCode.DEADLINE_EXCEEDED"
UNANSWERED = ("StatusCode.UNAVAILABLE", DEADLINE_EXCEEDED)
CONTEXT_ATTEMPTS = 2       # a context server that does not answer: once more on another
PROBE_TIMEOUT_SECONDS = 1.0   # a generation server that is not live by then is lost
KEEPALIVE_TIMEOUT_MS = 5_000   # a ping not answered by then: the channel's calls fail
RECONNECT_SECONDS = 2.0        # a call its unconnected channel failed is sent again if it connects by then


class Unanswered(Unavailable):
    """A server failed before it answered (module docstring), ``timed_out`` when it let the
    call's deadline pass. One line: gRPC's message ("failed to connect to all addresses;
    last error: ...: Connection refused") is cut to its last, most specific part."""

    def __init__(self, role: str, url: str, status: str, message: str, timeout: float):
        cause = " ".join(message.split()).rsplit(": ", 1)[-1]
        self.role, self.url = role, url
        self.timed_out = status == DEADLINE_EXCEEDED
        if self.timed_out:
            cause = f"no answer within {timeout:g} s"
        self.reason = f"{status.removeprefix('StatusCode.')}: {cause}"[:200]
        super().__init__(f"{role} server {url} did not answer ({self.reason})")


class CallObserver(Protocol):
    """Hears where calls go (:class:`~triton_disagg.triton.metrics.Metrics`)."""

    def routed(self, role: str, url: str) -> None:
        """A call of ``role`` went to ``url``."""

    def retried(self, role: str, url: str) -> None:
        """A context call is tried again elsewhere: ``url`` did not answer."""


class GrpcTransport:
    """The scheduler's side: ``routers`` per role (:func:`~triton_disagg.routing.pools.start_pools`);
    ``observer`` (optional) hears each call routed and each context call tried again.
    Clients are made on the event loop that uses them, with keepalive on, over TLS when
    ``tls`` (the config's ``grpc_tls``) is given."""

    def __init__(self, routers: dict[str, Router], observer: CallObserver | None = None,
                 tls: GrpcTLS | None = None):
        self.routers, self.observer, self.tls = routers, observer, tls
        self.credential = peer_credential()
        self.clients: dict[str, InferenceServerClient] = {}
        self.calls: dict[str, int] = {}          # url -> calls now using its client (> 0)

    def route(self, request_id: str, avoid: frozenset[str] = frozenset(),
              timeout: float = CALL_TIMEOUT_SECONDS) -> "GrpcRoute":
        return GrpcRoute(self, request_id, avoid, timeout)

    def routed(self, role: str, url: str) -> None:
        if self.observer is not None:
            self.observer.routed(role, url)

    def retried(self, role: str, url: str) -> None:
        if self.observer is not None:
            self.observer.retried(role, url)

    async def live(self, url: str) -> str | None:
        """None when the server at ``url`` says it is live within ``PROBE_TIMEOUT_SECONDS``,
        else why not (one line)."""
        from tritonclient.utils import InferenceServerException

        try:
            if await self._client(url).is_server_live(client_timeout=PROBE_TIMEOUT_SECONDS):
                return None
            return "it says it is not live"
        except InferenceServerException as exc:
            return f"liveness probe: {exc.status()}"

    async def infer(self, url: str, role: str, request_id: str, inputs: dict,
                    parameters: dict[str, str], timeout: float,
                    queue_timeout: float = 0.0, model: str | None = None
                    ) -> dict[str, np.ndarray]:
        """The outputs of a call of ``role`` to ``model`` (None: the role's own; a context
        instance's model: :attr:`~triton_disagg.routing.router.Member.model`);
        :class:`Unanswered` when the server failed before it answered or not within
        ``timeout`` seconds (DEADLINE_EXCEEDED). ``queue_timeout``: the Triton request's
        timeout (0: none)."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        specs, outputs = CALL_SPECS[role]
        model = model or role
        tensors = []
        for name, arr in to_batched(specs, inputs).items():
            tensors.append(grpcclient.InferInput(name, list(arr.shape), by_name(specs)[name].dtype))
            tensors[-1].set_data_from_numpy(arr)
        await self._close_departed()
        self.calls[url] = self.calls.get(url, 0) + 1
        try:
            for attempt in range(2):
                try:
                    result = await self._client(url).infer(
                        model, tensors, request_id=request_id, client_timeout=timeout,
                        timeout=microseconds(queue_timeout), parameters=parameters)
                    break
                except InferenceServerException as exc:
                    message = exc.message() or ""
                    code = from_grpc_status(exc.status(), message)
                    said_timeout = code is ErrorCode.TIMEOUT and exc.status() != DEADLINE_EXCEEDED
                    if exc.status() in UNANSWERED and not said_timeout:   # a tagged one answered
                        if not attempt and exc.status() != DEADLINE_EXCEEDED \
                                and await self._reconnected(url):
                            continue              # the call never left: send it again
                        self.routers[role].unanswered(url)
                        raise Unanswered(role, url, exc.status(), message, timeout) from None
                    error = callee_error(code, message)
                    raise type(error)(f"{model} at {url}: {error}") from None
        finally:
            self.calls[url] -= 1
            if not self.calls[url]:
                del self.calls[url]
        arrays = {s.name: result.as_numpy(s.name) for s in outputs}
        return unbatch({n: a for n, a in arrays.items() if a is not None})

    async def _reconnected(self, url: str) -> bool:
        """Whether the channel to ``url`` was not connected, so that a call it failed never
        reached the server, and connects within ``RECONNECT_SECONDS``: a server back from an
        outage answers its peers' probes while this channel still waits out gRPC's reconnect
        backoff (up to ``grpc_channel.MAX_RECONNECT_BACKOFF_MS``)."""
        import grpc

        channel = self._client(url)._channel      # tritonclient's grpc.aio channel
        if channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return False
        try:
            await asyncio.wait_for(channel.channel_ready(), RECONNECT_SECONDS)
        except asyncio.TimeoutError:
            return False
        return True

    def _client(self, url: str) -> InferenceServerClient:
        if url not in self.clients:
            import tritonclient.grpc as grpc
            import tritonclient.grpc.aio as grpcclient

            keepalive = grpc.KeepAliveOptions(
                keepalive_time_ms=KEEPALIVE_MS, keepalive_timeout_ms=KEEPALIVE_TIMEOUT_MS,
                keepalive_permit_without_calls=True, http2_max_pings_without_data=0)
            self.clients[url] = grpcclient.InferenceServerClient(
                url, **client_options(self.tls, keepalive))
        return self.clients[url]

    async def _close_departed(self) -> None:
        """Close the clients of servers that left every pool, once no call uses them."""
        members = {m.url for router in self.routers.values() for m in router.members()}
        for url in [u for u in self.clients if u not in members and u not in self.calls]:
            await self.clients.pop(url).close()

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()


class GrpcRoute:
    """One request's calls over gRPC. Its context call's router assignment ends when context
    answers; its generation assignment lasts until :meth:`close` (the request ended). Its
    generation call goes to no server in ``avoid``. Each context attempt and the generation
    call have a deadline of ``timeout`` seconds: a context server that misses it counts as
    not answering (tried once more on another)."""

    cancellable = True       # a cancelled call is cancelled at the server (gRPC)

    def __init__(self, transport: GrpcTransport, request_id: str, avoid: frozenset[str],
                 timeout: float):
        self.transport, self.request_id, self.avoid = transport, request_id, avoid
        self.timeout = timeout
        self.context_url: str | None = None     # the server that holds the request's KV,
        self.context_model: str | None = None   # in this model (None: "context")
        self.generation = None                  # its generation Assignment, once accepted

    async def context(self, request: EngineRequest,
                      listener: bytes = b"") -> dict[str, np.ndarray]:
        router, failed = self.transport.routers["context"], []
        prompt, inputs = request.prompt_ids, call_inputs(request, listener=listener)
        for _ in range(CONTEXT_ATTEMPTS):
            try:
                assignment = router.take(len(prompt), [f.url for f in failed], token_ids=prompt,
                                         salt=request.params.cache_salt)
            except NoServer as exc:
                raise _unanswered(failed, f"; {exc}") if failed else exc from None
            if failed:
                self.transport.retried("context", failed[-1].url)
            self.transport.routed("context", assignment.url)
            try:
                outputs = await self.transport.infer(
                    assignment.url, "context", self.request_id, inputs,
                    call_parameters(self.transport.credential, P.CONTEXT_ONLY), self.timeout,
                    queue_timeout=self.timeout, model=assignment.model)
            except Unanswered as exc:
                failed.append(exc)
                continue
            finally:
                assignment.release()
            self.context_url, self.context_model = assignment.url, assignment.model
            return outputs
        raise _unanswered(failed, "")

    async def release(self, request: EngineRequest, handle: bytes) -> None:
        await self.transport.infer(self.context_url, "context", self.request_id,
                                   call_inputs(request, handle=handle),
                                   call_parameters(self.transport.credential, P.RELEASE_KV),
                                   min(self.timeout, RELEASE_TIMEOUT_SECONDS),
                                   model=self.context_model)

    async def generate(self, request: EngineRequest, request_type: str, token_address: str,
                       handle: bytes = b"") -> GenerationAnswer:
        tokens = len(request.prompt_ids) + request.params.max_tokens
        assignment = self.transport.routers["generation"].take(tokens, self.avoid)
        self.transport.routed("generation", assignment.url)
        try:
            outputs = await self.transport.infer(
                assignment.url, "generation", self.request_id,
                call_inputs(request, handle=handle),
                call_parameters(self.transport.credential, request_type, token_address),
                self.timeout)
        except Unanswered as exc:
            assignment.release()
            raise GenerationLost(exc.url, exc.reason) from None
        except BaseException:
            assignment.release()
            raise
        answer = generation_answer(outputs)
        if answer.declined:           # it holds nothing of the request: nothing in flight
            assignment.release()
        else:
            self.generation = assignment
        return answer

    async def lost(self) -> GenerationLost | None:
        if self.generation is None:
            return None
        url = self.generation.url
        reason = await self.transport.live(url)
        if reason is None:
            return None
        self.transport.routers["generation"].unanswered(url)
        return GenerationLost(url, reason)

    def close(self) -> None:
        if self.generation is not None:
            self.generation.release()


def _unanswered(failed: list[Unanswered], tail: str) -> Unavailable:
    """One line for the context servers that did not answer, each url with its reason: a
    :class:`Timeout` when every one of them let its deadline pass."""
    tried = ", ".join(f"{f.url} ({f.reason})" for f in failed)
    servers = f"context server{'s' if len(failed) > 1 else ''}"
    if all(f.timed_out for f in failed):
        return Timeout(f"{servers} timed out: {tried}{tail}")
    return Unavailable(f"{servers} did not answer: {tried}{tail}")

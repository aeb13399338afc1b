"""Errors cross every seam by their code (:class:`triton_disagg.errors.ErrorCode`), never by
their words: at each seam an error whose message says something else (an INVALID_ARG that
says "unavailable, timed out", an INTERNAL that says "busy") keeps its code. Seams: a model's
Triton error (``error_response``) and the BLS reading of it, a Triton error over gRPC (the
orchestrator's calls; the HTTP front's stream, against a real gRPC server standing in for
Triton), a ZeroMQ error event into the orchestrator's token inbox. The HTTP front's statuses
per code: tests/unit/test_http_front_app.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import zmq
from tritonclient.grpc import service_pb2, service_pb2_grpc

from orchestrator_fakes import SMALL_REQUEST
from triton_disagg import token_wire
from triton_disagg.errors import (CODE_IN_MESSAGE, HTTP_STATUS, EngineError, ErrorCode,
                                  RequestError, Timeout, Unavailable, code_in, from_grpc_status,
                                  from_triton, triton_status, with_code, without_tag)
from triton_disagg.front.orchestrator_call import OrchestratorError, Relay
from triton_disagg.front.token_inbox import TokenInbox
from triton_disagg.front.grpc_transport import GrpcTransport, Unanswered
from triton_disagg.front.engine_calls import BLSTransport
from triton_disagg.launch.deploy import free_ports
from triton_disagg.routing.pools import StaticMembers
from triton_disagg.routing.router import Router
from triton_disagg.engine.sequence import TokenEvent
from triton_disagg.triton.tensors import error_response
from triton_disagg.zmq_endpoints import push_socket

MISLEADING = "TIMEOUT: no server: unavailable, busy, lost, not ready, timed out"
# Each code as an error answer, and the class it is raised as on this side.
RAISED = [(ErrorCode.INVALID_ARG, RequestError), (ErrorCode.UNAVAILABLE, Unavailable),
          (ErrorCode.TIMEOUT, Timeout), (ErrorCode.INTERNAL, EngineError)]


# ---- the vocabulary ------------------------------------------------------------------------

@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_code_leaves_a_model_and_reads_back_as_itself(code):
    name, message = triton_status(code, MISLEADING)
    assert from_triton(name, message) is code
    assert without_tag(message) == MISLEADING.removeprefix("TIMEOUT: ")
    assert code in HTTP_STATUS


@pytest.mark.parametrize("status, message, code", [
    ("StatusCode.INVALID_ARGUMENT", MISLEADING, ErrorCode.INVALID_ARG),
    ("StatusCode.INTERNAL", MISLEADING, ErrorCode.INTERNAL),
    ("StatusCode.UNAVAILABLE", "the prompt is invalid", ErrorCode.UNAVAILABLE),
    ("StatusCode.UNAVAILABLE", "TIMEOUT: context timed out", ErrorCode.TIMEOUT),
    ("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded", ErrorCode.TIMEOUT),
    ("StatusCode.NOT_FOUND", "Request for unknown model", ErrorCode.UNAVAILABLE),
    ("StatusCode.CANCELLED", "Locally cancelled", ErrorCode.CANCELLED),
    (None, MISLEADING, ErrorCode.INTERNAL),         # an error that carries no status
])
def test_a_grpc_status_is_read_by_its_code_not_its_message(status, message, code):
    assert from_grpc_status(status, message) is code


# ---- a model's Triton error, and BLS reading it -----------------------------------------------

class FakeTritonError:
    """``pb_utils.TritonError``: the codes the python backend stub defines."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED = range(6)
    ALREADY_EXISTS, CANCELLED = 6, 7

    def __init__(self, message: str, code: int = 1):
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class FakeResponse:
    def __init__(self, output_tensors=(), error=None):
        self.error_ = error

    def has_error(self) -> bool:
        return self.error_ is not None

    def error(self) -> FakeTritonError:
        return self.error_


@pytest.mark.parametrize("code, raised", RAISED)
def test_a_bls_error_answer_is_raised_by_its_code(code, raised):
    """A model answers with ``error_response``; the orchestrator's BLS call raises the class
    of its code, whatever the message says (``serve all``)."""
    pb = SimpleNamespace(TritonError=FakeTritonError, InferenceResponse=FakeResponse,
                         Tensor=lambda name, array: (name, array))
    answer = error_response(pb, "bad", code)

    class Request:
        def __init__(self, **_):
            pass

        async def async_exec(self):
            return answer

    pb.InferenceRequest = Request
    route = BLSTransport(pb, max_calls=4).route("req-1")
    with pytest.raises(raised) as err:
        asyncio.run(route.context(SMALL_REQUEST))
    assert type(err.value) is raised and str(err.value) == "bad"   # the tag is not the words


# ---- a Triton error over gRPC: the orchestrator's calls ------------------------------------

class FailingServer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """A Triton stand-in whose every call fails with ``code`` and ``details``: a unary call
    ends with that status; a stream answers as Triton does without ``triton_grpc_error``
    (an error message without a status, then the stream ends as usual), the code in the
    message when the request asked for it (``errors.CODE_IN_MESSAGE``) and
    ``code_in_message``, as the orchestrator does. It and its models are ``ready`` or not.
    ``headers``: each stream's metadata."""

    def __init__(self, code: grpc.StatusCode, details: str, code_in_message: bool = True,
                 ready: bool = True):
        self.code, self.details, self.code_in_message = code, details, code_in_message
        self.ready = ready
        self.headers: list[dict] = []

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.ready)

    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=self.ready)

    async def ModelInfer(self, request, context):
        await context.abort(self.code, self.details)

    async def ModelStreamInfer(self, request_iterator, context):
        self.headers.append(dict(context.invocation_metadata()))
        async for request in request_iterator:
            asked = request.parameters[CODE_IN_MESSAGE].bool_param and self.code_in_message
            code = from_grpc_status(f"StatusCode.{self.code.name}", self.details)
            yield service_pb2.ModelStreamInferResponse(
                error_message=with_code(code, without_tag(self.details)) if asked
                else self.details)


async def _serving(servicer) -> tuple[grpc.aio.Server, str]:
    url = f"127.0.0.1:{free_ports(1)[0]}"
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    server.add_insecure_port(url)
    await server.start()
    return server, url


@pytest.mark.parametrize("status, raised", [(grpc.StatusCode.INVALID_ARGUMENT, RequestError),
                                            (grpc.StatusCode.INTERNAL, EngineError)])
def test_a_grpc_error_answer_is_raised_by_its_status(status, raised):
    async def main():
        server, url = await _serving(FailingServer(status, MISLEADING))
        routers = {"context": Router("context", "round_robin", StaticMembers("context", [url])),
                   "generation": Router("generation", "round_robin",
                                        StaticMembers("generation", []))}
        transport = GrpcTransport(routers)
        try:
            await transport.route("req-1", frozenset(), 5.0).context(SMALL_REQUEST)
        finally:
            await transport.close()
            await server.stop(None)

    with pytest.raises((RequestError, EngineError)) as err:
        asyncio.run(main())
    assert type(err.value) is raised, err.value


def test_a_server_that_answers_it_timed_out_is_a_timeout_not_a_server_that_did_not_answer():
    """A context's own queue deadline comes back as UNAVAILABLE tagged TIMEOUT: the server
    answered, so it is not passed over and the request ends in a Timeout (504)."""
    async def main():
        server, url = await _serving(FailingServer(grpc.StatusCode.UNAVAILABLE,
                                                   "TIMEOUT: context: waited past its deadline"))
        routers = {"context": Router("context", "round_robin", StaticMembers("context", [url])),
                   "generation": Router("generation", "round_robin",
                                        StaticMembers("generation", []))}
        transport = GrpcTransport(routers)
        try:
            with pytest.raises(Timeout) as err:
                await transport.route("req-1", frozenset(), 5.0).context(SMALL_REQUEST)
            assert not isinstance(err.value, Unanswered), err.value
            assert not routers["context"]._passed_over, "a server that answered was passed over"
        finally:
            await transport.close()
            await server.stop(None)

    asyncio.run(main())


# ---- a Triton error over gRPC: the HTTP front's stream -------------------------------------

@pytest.mark.parametrize("status, code", [
    (grpc.StatusCode.INVALID_ARGUMENT, ErrorCode.INVALID_ARG),
    (grpc.StatusCode.UNAVAILABLE, ErrorCode.TIMEOUT),        # MISLEADING has the TIMEOUT tag
    (grpc.StatusCode.INTERNAL, ErrorCode.INTERNAL),
])
def test_the_fronts_stream_reads_the_orchestrators_code_from_its_message(status, code):
    """The code rides in the error message the front asked for; not Triton's
    ``triton_grpc_error`` mode (its 2.51 closes the stream from the callback thread: see
    front/orchestrator_call.py), and the stream ends as usual, not cancelled."""
    servicer = FailingServer(status, MISLEADING)
    error = _streamed(servicer)
    assert error.code is code and error.status == HTTP_STATUS[code]
    assert str(error) == MISLEADING.removeprefix("TIMEOUT: ")
    assert [h.get("triton_grpc_error") for h in servicer.headers] == [None]


def test_a_stream_error_without_a_code_is_internal_whatever_it_says():
    """A server that ignores ``errors.CODE_IN_MESSAGE``: its error message names no code."""
    error = _streamed(FailingServer(grpc.StatusCode.INVALID_ARGUMENT, MISLEADING, False))
    assert error.code is ErrorCode.INTERNAL and error.status == 500
    assert str(error) == MISLEADING.removeprefix("TIMEOUT: ")


@pytest.mark.parametrize("details", ["Request for unknown model: 'orchestrator' is not found",
                                     MISLEADING])
def test_tritons_own_stream_error_while_not_ready_is_unavailable(details):
    """An untagged error is Triton's own (the orchestrator unknown, not loaded, unloading):
    with the models not ready it is a 503 (with Retry-After at the front), not a 500,
    whatever its message says."""
    error = _streamed(FailingServer(grpc.StatusCode.INTERNAL, details, False, ready=False))
    assert error.code is ErrorCode.UNAVAILABLE and error.status == 503
    assert str(error) == details.removeprefix("TIMEOUT: ")


def test_a_code_in_a_message_reads_back_and_a_bare_bracket_is_no_code():
    for code in ErrorCode:
        assert code_in(with_code(code, "[x] y")) == (code, "[x] y")
    assert code_in("TIMEOUT: " + with_code(ErrorCode.TIMEOUT, "late")) == (ErrorCode.TIMEOUT,
                                                                         "late")
    for bare in ("[BOGUS] x", "[INVALID_ARG]x", "INVALID_ARG x", ""):
        assert code_in(bare) == (None, bare)


def _streamed(servicer) -> OrchestratorError:
    async def main():
        server, url = await _serving(servicer)
        relay = Relay(url)
        try:
            async for _ in relay.stream({"text_input": np.array([[b"x"]], np.object_)}, "r-1"):
                pass
        finally:
            await relay.close()
            await server.stop(None)

    with pytest.raises(OrchestratorError) as err:
        asyncio.run(main())
    return err.value


# ---- a ZeroMQ error event into the orchestrator -------------------------------------------

@pytest.mark.parametrize("code, raised", RAISED)
def test_a_token_error_event_is_raised_by_its_code(code, raised):
    async def main():
        inbox = TokenInbox(None, stall_seconds=5.0, on_death=lambda *_: None)
        with inbox.open("req-1") as stream:
            context = zmq.Context()
            sock = push_socket(context, inbox.address, 10)
            sock.send(token_wire.encode_events([TokenEvent(
                "req-1", [], error=MISLEADING, code=code, key=stream.key)]))
            try:
                await stream.next()
            finally:
                sock.close()
                context.term()
                inbox.close()

    with pytest.raises((RequestError, EngineError)) as err:
        asyncio.run(main())
    assert type(err.value) is raised and str(err.value) == MISLEADING

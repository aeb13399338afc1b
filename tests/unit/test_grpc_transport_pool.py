"""The gRPC transport over a pool of routers (:mod:`test_router`), without tritonserver: a
context server that does not answer (refuses, or says nothing until the deadline) is tried
once on another (a stand-in Triton gRPC server answers), every call carries the
deployment's peer credential and names the instance model the router chose, and every
failure is one line naming the role and the url(s) tried; context servers that all let the
deadline pass are a Timeout (504 at the HTTP front), one that refused among them is not; a
declined generation call holds nothing in flight."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from orchestrator_fakes import SMALL_REQUEST
from test_router import Source
from tritonclient.grpc import service_pb2, service_pb2_grpc

from triton_disagg import protocol as P
from triton_disagg.triton import tensors
from triton_disagg.launch.deploy import free_ports
from triton_disagg.errors import HTTP_STATUS, EngineError, Timeout
from triton_disagg.routing.pools import StaticMembers
from triton_disagg.routing.router import Member, Router
from triton_disagg.front.grpc_transport import GrpcTransport
class Observed:
    """The router observer of serving.metrics.Metrics, recorded."""

    def __init__(self):
        self.events: list[tuple[str, str, str]] = []

    def routed(self, role, url):
        self.events.append(("routed", role, url))

    def retried(self, role, url):
        self.events.append(("retried", role, url))


class ContextStandIn(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers every ModelInfer with a first token, as a context server would; ``mute``:
    never answers (a stopped server whose socket still accepts)."""

    def __init__(self, mute: bool = False):
        self.request_ids: list[str] = []
        self.credentials: list[str] = []          # each call's peer_credential parameter
        self.calls: list[tuple[str, str]] = []    # (model called, request_type) of each call
        self.mute = mute

    async def ModelInfer(self, request, context):
        self.request_ids.append(request.id)
        self.calls.append((request.model_name, request.parameters[P.REQUEST_TYPE].string_param))
        self.credentials.append(request.parameters[P.PEER_CREDENTIAL].string_param)
        if self.mute:
            await asyncio.Event().wait()
        response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name="output_ids", datatype="INT32", shape=[1, 1])
        response.raw_output_contents.append(np.array([[7]], np.int32).tobytes())  # [batch, 1]
        return response


async def _stand_in(url: str, mute: bool = False) -> tuple[grpc.aio.Server, ContextStandIn]:
    """A started stand-in context server at ``url``."""
    server, standin = grpc.aio.server(), ContextStandIn(mute)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(standin, server)
    server.add_insecure_port(url)
    await server.start()
    return server, standin




def _transport(context_urls, generation_urls, observer, context_instances=1):
    routers = {"context": Router("context", "round_robin", StaticMembers(
                   "context", context_urls, instances=context_instances)),
               "generation": Router("generation", "round_robin",
                                    StaticMembers("generation", generation_urls))}
    return GrpcTransport(routers, observer)


def test_a_context_server_that_does_not_answer_is_tried_once_on_another():
    # round robin starts at the first url in order: make that one dead (nothing listens)
    dead, live = sorted(f"127.0.0.1:{port}" for port in free_ports(2))
    observed = Observed()

    async def main():
        server, standin = await _stand_in(live)
        transport = _transport([dead, live], [], observed)
        try:
            route = transport.route("req-1")
            outputs = await route.context(SMALL_REQUEST)
            return outputs, route, standin.request_ids, transport
        finally:
            await transport.close()
            await server.stop(None)

    outputs, route, seen, transport = asyncio.run(main())
    assert outputs["output_ids"].tolist() == [7] and seen == ["req-1"]
    assert route.context_url == live                  # the release would go there
    assert observed.events == [("routed", "context", dead), ("retried", "context", dead),
                               ("routed", "context", live)]
    assert transport.routers["context"].in_flight == {}


def test_each_context_call_and_its_release_name_the_instance_model_the_router_chose():
    """A context server of 2 instances is 2 members, each its own Triton model: the call
    goes to the model picked (round robin: one, then the other) and the release to the
    model that holds the request's KV; a server that does not answer is left whole (its
    other instance is not tried: the retry goes to another server)."""
    dead, live = sorted(f"127.0.0.1:{port}" for port in free_ports(2))   # round robin: dead first
    observed = Observed()

    async def main():
        server, standin = await _stand_in(live)
        transport = _transport([dead, live], [], observed, context_instances=2)
        try:
            routes = []
            for i in range(3):
                routes.append(transport.route(f"req-{i}"))
                await routes[-1].context(SMALL_REQUEST)
                await routes[-1].release(SMALL_REQUEST, bytes(4))
            return standin.calls, routes, transport
        finally:
            await transport.close()
            await server.stop(None)

    calls, routes, transport = asyncio.run(main())
    assert [(r.context_url, r.context_model) for r in routes] == [
        (live, "context_1"), (live, None), (live, "context_1")]
    assert calls == [("context_1", P.CONTEXT_ONLY), ("context_1", P.RELEASE_KV),
                     ("context", P.CONTEXT_ONLY), ("context", P.RELEASE_KV),
                     ("context_1", P.CONTEXT_ONLY), ("context_1", P.RELEASE_KV)]
    assert observed.events[:3] == [("routed", "context", dead), ("retried", "context", dead),
                                   ("routed", "context", live)]
    assert transport.routers["context"].in_flight == {}


def test_a_context_server_that_says_nothing_is_left_at_the_deadline_for_another():
    mute, live = sorted(f"127.0.0.1:{port}" for port in free_ports(2))   # round robin: mute first
    observed = Observed()

    async def main():
        started, standins = [], {}
        for url, silent in ((mute, True), (live, False)):
            server, standins[url] = grpc.aio.server(), ContextStandIn(mute=silent)
            service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(standins[url], server)
            server.add_insecure_port(url)
            await server.start()
            started.append(server)
        transport = _transport([mute, live], [], observed)
        try:
            begun = asyncio.get_running_loop().time()
            route = transport.route("req-1", frozenset(), 1.0)
            outputs = await asyncio.wait_for(route.context(SMALL_REQUEST), 20)
            return outputs, route, standins, asyncio.get_running_loop().time() - begun
        finally:
            await transport.close()
            for server in started:
                await server.stop(None)

    outputs, route, standins, took = asyncio.run(main())
    assert outputs["output_ids"].tolist() == [7] and route.context_url == live
    assert 1.0 <= took < 5, took                       # one deadline, then the other answered
    assert observed.events == [("routed", "context", mute), ("retried", "context", mute),
                               ("routed", "context", live)]
    credential = tensors.peer_credential()
    assert standins[mute].credentials == standins[live].credentials == [credential]


@pytest.mark.parametrize("role", ["context", "generation"])
def test_servers_that_cannot_be_reached_fail_in_one_line_naming_role_and_urls(role):
    urls = [f"127.0.0.1:{p}" for p in free_ports(2)]              # nothing listens there
    observed = Observed()
    transport = _transport(urls if role == "context" else ["127.0.0.1:1"],
                           urls if role == "generation" else [], observed)

    async def main():
        route = transport.route("req-1")
        try:
            if role == "context":
                await route.context(SMALL_REQUEST)
            else:
                await route.generate(SMALL_REQUEST, P.GENERATION_ONLY, "tcp://127.0.0.1:1")
        finally:
            route.close()
            await transport.close()

    with pytest.raises(EngineError) as err:
        asyncio.run(main())
    message = str(err.value)
    assert "\n" not in message and "UNAVAILABLE" in message, message
    if role == "context":         # both tried, each named once
        assert message.startswith("context servers did not answer: ")
        assert all(message.count(url) == 1 for url in urls), message
        assert [e[0] for e in observed.events] == ["routed", "retried", "routed"]
    else:                         # lost: the orchestrator migrates the request, not the route
        assert message.startswith(f"generation server {sorted(urls)[0]} was lost (UNAVAILABLE")
        assert [e[0] for e in observed.events] == ["routed"]
    assert all(router.in_flight == {} for router in transport.routers.values())


def test_one_context_server_that_does_not_answer_says_none_is_left():
    url = f"127.0.0.1:{free_ports(1)[0]}"
    transport = _transport([url], [], Observed())

    async def main():
        try:
            await transport.route("req-1").context(SMALL_REQUEST)
        finally:
            await transport.close()

    with pytest.raises(EngineError) as err:
        asyncio.run(main())
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"context server did not answer: {url} (")
    assert message.endswith("; no other context server to try (in context_server.urls)")


@pytest.mark.parametrize("with_dead", [False, True])
def test_context_servers_that_all_pass_the_deadline_are_a_timeout(with_dead):
    """A mute context server alone: Timeout, whose code the front maps to 504; beside one
    that refused the connection: Unavailable (503)."""
    mute, dead = (f"127.0.0.1:{port}" for port in free_ports(2))     # nothing listens on dead

    async def main():
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(ContextStandIn(mute=True),
                                                                    server)
        server.add_insecure_port(mute)
        await server.start()
        transport = _transport([mute, dead] if with_dead else [mute], [], Observed())
        try:
            await transport.route("req-1", frozenset(), 0.5).context(SMALL_REQUEST)
        finally:
            await transport.close()
            await server.stop(None)

    with pytest.raises(EngineError) as err:
        asyncio.run(main())
    message = str(err.value)
    assert "\n" not in message and f"{mute} (DEADLINE_EXCEEDED: no answer within 0.5 s)" in message
    assert isinstance(err.value, Timeout) != with_dead, message
    assert HTTP_STATUS[err.value.status] == (503 if with_dead else 504)


def test_the_client_of_a_server_that_left_is_closed():
    source = Source(Member("127.0.0.1:1"), Member("127.0.0.1:2"))
    routers = {"context": Router("context", "round_robin", source),
               "generation": Router("generation", "round_robin", Source())}
    transport = GrpcTransport(routers)

    async def main():
        for _ in range(2):
            with pytest.raises(EngineError):
                await transport.route("r").context(SMALL_REQUEST)
        opened = sorted(transport.clients)
        source.current = (Member("127.0.0.1:2"),)        # 1 left
        with pytest.raises(EngineError):
            await transport.route("r").context(SMALL_REQUEST)
        left = sorted(transport.clients)
        await transport.close()
        return opened, left

    opened, left = asyncio.run(main())
    assert opened == ["127.0.0.1:1", "127.0.0.1:2"] and left == ["127.0.0.1:2"]


class GenerationStandIn(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers every generation call at once with ``control`` ("": declined, as a generation
    server answers a context_and_generation_if_cached prompt it does not hold)."""

    def __init__(self, control: str):
        self.control = control.encode()

    async def ModelInfer(self, request, context):
        response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name=P.CONTROL_ADDRESS, datatype="BYTES", shape=[1, 1])
        response.raw_output_contents.append(len(self.control).to_bytes(4, "little")
                                            + self.control)
        response.outputs.add(name=P.KV_LISTENER, datatype="UINT8", shape=[1, 0])
        response.raw_output_contents.append(b"")
        return response


@pytest.mark.parametrize("control", ["", "ipc:///control"])
def test_a_declined_generation_call_holds_nothing_in_flight(control):
    """A generation server that declines (empty control address) took nothing: its
    assignment is released at once, so the route's later generation call (after the
    context) is the only one counted; an accepted one counts until the route closes."""
    (url,) = [f"127.0.0.1:{port}" for port in free_ports(1)]

    async def main():
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(GenerationStandIn(control),
                                                                    server)
        server.add_insecure_port(url)
        await server.start()
        transport = _transport([], [url], None)
        try:
            route = transport.route("req-1")
            answer = await route.generate(SMALL_REQUEST, P.CONTEXT_AND_GENERATION_IF_CACHED,
                                          "ipc:///tokens#k")
            held = dict(transport.routers["generation"].in_flight)
            route.close()
            return answer, held, transport.routers["generation"].in_flight
        finally:
            await transport.close()
            await server.stop(None)

    answer, held, after = asyncio.run(main())
    assert answer.declined == (not control) and answer.control_address == control
    assert held == ({} if not control else {url: 11}) and after == {}

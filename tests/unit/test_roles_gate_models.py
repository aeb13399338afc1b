"""The scheduler's roles gate asks a context server for each instance model the scheduler
will call there: a static pool that places more context instances than the server runs
(it would call models the server lacks) keeps the scheduler not ready, in one line naming
the server and the model; one that runs them all is ready. A stand-in Triton gRPC server
answers ServerReady and ModelReady."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from triton_disagg.launch.deploy import free_ports
from triton_disagg.launch.roles_gate import RoleServers
from triton_disagg.routing.pools import StaticMembers


class ReadyStandIn(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, models: set[str]):
        self.models = models

    def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=True)

    def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=request.name in self.models)


@pytest.fixture
def context_server():
    url = f"127.0.0.1:{free_ports(1)[0]}"
    standin = ReadyStandIn(set())
    server = grpc.server(ThreadPoolExecutor(2))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(standin, server)
    server.add_insecure_port(url)
    server.start()
    yield url, standin
    server.stop(None)


def test_a_server_lacking_an_instance_model_the_scheduler_calls_is_named(context_server):
    url, standin = context_server
    peers = RoleServers({"context": StaticMembers("context", [url], instances=2)})
    try:
        standin.models = {"context"}                   # it runs one instance, we place two
        assert peers.missing() == (f"no context server in context_server.urls answers "
                                   f"({url} without model context_1)")
        standin.models = {"context", "context_1"}
        assert peers.missing() is None
    finally:
        peers.close()


def test_a_role_called_by_its_own_model_alone_is_asked_only_if_the_server_is_ready(
        context_server):
    url, standin = context_server
    peers = RoleServers({"generation": StaticMembers("generation", [url], instances=2)})
    try:
        assert peers.missing() is None                 # no ModelReady asked: it has none
    finally:
        peers.close()

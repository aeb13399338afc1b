"""A peer's gRPC answer is bounded: tritonclient with this project's channel options refuses
a message past ``MAX_MESSAGE_BYTES`` before holding it (its default is 2 GiB). The peer is
an in-process gRPC server answering Triton's ``ModelInfer`` with raw bytes."""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from triton_disagg.triton.grpc_channel import MAX_MESSAGE_BYTES, client_options

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


def _peer(answer: bytes) -> tuple[grpc.Server, int]:
    """A server whose every ModelInfer answers ``answer`` as is."""

    def handle(request: bytes, context) -> bytes:
        return answer

    handler = grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {
        "ModelInfer": grpc.unary_unary_rpc_method_handler(handle)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), handlers=(handler,),
                         options=[("grpc.max_send_message_length", -1)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _infer(port: int) -> grpcclient.InferResult:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}", **client_options(None))
    tensor = grpcclient.InferInput("x", [1], "INT32")
    tensor.set_data_from_numpy(np.zeros(1, np.int32))
    try:
        return client.infer("m", [tensor], client_timeout=60)
    finally:
        client.close()


def test_an_answer_past_the_bound_is_refused():
    server, port = _peer(b"\0" * (MAX_MESSAGE_BYTES + 1))
    try:
        with pytest.raises(InferenceServerException) as refused:
            _infer(port)
    finally:
        server.stop(None)
    assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"


def test_an_answer_within_the_bound_is_read():
    answer = service_pb2.ModelInferResponse(model_name="m", id="within")
    server, port = _peer(answer.SerializeToString())
    try:
        assert _infer(port).get_response().id == "within"
    finally:
        server.stop(None)

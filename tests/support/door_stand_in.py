"""An in-process stand-in tritonserver (grpc.aio) and the public gRPC door in front of it,
for unit tests of the door (tests/unit/test_public_door_gates.py,
tests/unit/test_door_stream_relay.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
from local_sites import free_port

from triton_disagg.front.public_door import SERVICE, GrpcDoor

STREAM = f"/{SERVICE}/ModelStreamInfer"


def echoed(message: bytes) -> bytes:
    """The stand-in's answer to a stream's ``message``, as Triton answers one: a
    ``ModelStreamInferResponse`` whose ``infer_response`` (field 2, tag 0x12; not an error)
    holds the message's bytes."""
    from google.protobuf.internal.encoder import _VarintBytes

    return b"\x12" + _VarintBytes(len(message)) + message


async def stream_server(handler=None, unary=None) -> tuple[grpc.aio.Server, int]:
    """A started stand-in tritonserver whose ``ModelStreamInfer`` is ``handler`` (default:
    an echo, :func:`echoed`) and whose unary methods are ``unary`` (name -> handler)."""
    async def echo(requests, context):
        async for request in requests:
            yield echoed(request)

    methods = {"ModelStreamInfer": grpc.stream_stream_rpc_method_handler(handler or echo)}
    methods.update({name: grpc.unary_unary_rpc_method_handler(f)
                    for name, f in (unary or {}).items()})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, methods)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def held_until(door: GrpcDoor, held: bool, seconds: float = 10) -> int:
    """Wait up to ``seconds`` for the door's budget to hold bytes (``held``) or none, of
    its pool and its calls' reserves; the bytes held then."""
    def holds() -> int:
        return door.budget.held + door.budget.reserved

    wait = time.monotonic() + seconds
    while bool(holds()) != held and time.monotonic() < wait:
        await asyncio.sleep(0.05)
    return holds()


@contextlib.asynccontextmanager
async def open_door(max_calls: int | None = 4, max_bytes: int = 1 << 20, handler=None, unary=None,
                **kwargs):
    """A started door in front of a started stand-in (:func:`stream_server`); both stopped
    after."""
    inner, inner_port = await stream_server(handler, unary)
    door = GrpcDoor("127.0.0.1", free_port(), f"127.0.0.1:{inner_port}", max_bytes, max_calls,
                    **kwargs)
    await door.start()
    try:
        yield door
    finally:
        await door.stop(0)
        await inner.stop(0)


def infer_request(strings: int, name: str = "ensemble", request_id: str = "") -> bytes:
    """A serialized ModelInferRequest with one BYTES input of ``strings`` empty strings."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=name, id=request_id)
    words = request.inputs.add(name="stop_words", datatype="BYTES", shape=[1, strings])
    words.contents.bytes_contents.extend([b""] * strings)
    return request.SerializeToString()

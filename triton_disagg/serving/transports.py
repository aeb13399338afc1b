"""How the orchestrator reaches context and generation: in-process BLS or tritonclient gRPC.

Both implement :class:`triton_disagg.serving.orchestrator.Transport` and move
the tensors of :data:`protocol.ENGINE_INPUTS` / ``CONTEXT_OUTPUTS`` unchanged
(batch axis of 1 added on the way out, removed on the way back), with the
phase in the ``request_type`` request parameter and the orchestrator's request
id as the Triton request id. A generation request also names the orchestrator's
token address (``token_address``); Triton carries it to generation, whose one
response is the control address for stops: the tokens themselves arrive over
ZeroMQ (:mod:`token_inbox`), never as Triton responses. A context error that is
back-pressure (``protocol.CONTEXT_BUSY``) is raised as :class:`ContextBusy`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from triton_disagg import protocol as P
from triton_disagg.serving.orchestrator import ContextBusy, EngineError
from triton_disagg.serving.tensors import to_batched

_SPECS = {"context": (P.CONTEXT_INPUTS, P.CONTEXT_OUTPUTS),
          "generation": (P.GENERATION_INPUTS, P.GENERATION_OUTPUTS)}


def _unbatch(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: arr[0] for name, arr in arrays.items()}


def _parameters(request_type: str, token_address: str | None) -> dict[str, str]:
    params = {P.REQUEST_TYPE: request_type}
    if token_address is not None:
        params[P.TOKEN_ADDRESS] = token_address
    return params


def _error(model: str, message: str) -> EngineError:
    busy = model == "context" and message.startswith(P.CONTEXT_BUSY)
    return (ContextBusy if busy else EngineError)(message)


def _release_inputs(inputs: dict, handle: np.ndarray) -> dict:
    return dict(inputs, **{P.CONTEXT_PHASE_PARAMS: handle})


def _control_address(outputs: dict[str, np.ndarray]) -> str:
    value = np.asarray(outputs[P.CONTROL_ADDRESS]).reshape(-1)[0]     # [1] -> scalar
    return value.decode() if isinstance(value, bytes) else str(value)


class BLSTransport:
    def __init__(self, pb_utils: Any):
        self.pb = pb_utils

    async def _exec(self, model: str, request_id: str, inputs: dict,
                    parameters: dict[str, str]) -> dict[str, np.ndarray]:
        specs, outputs = _SPECS[model]
        tensors = [self.pb.Tensor(n, a) for n, a in to_batched(specs, inputs).items()]
        request = self.pb.InferenceRequest(
            model_name=model, inputs=tensors, request_id=request_id,
            requested_output_names=[s.name for s in outputs], parameters=parameters)
        response = await request.async_exec()
        if response.has_error():
            raise _error(model, response.error().message())
        return _unbatch({t.name(): t.as_numpy() for t in response.output_tensors()})

    async def context(self, request_id: str, inputs: dict) -> dict[str, np.ndarray]:
        return await self._exec("context", request_id, inputs, _parameters(P.CONTEXT_ONLY, None))

    async def release(self, request_id: str, inputs: dict, handle: np.ndarray) -> None:
        await self._exec("context", request_id, _release_inputs(inputs, handle),
                        _parameters(P.RELEASE_KV, None))

    async def generate(self, request_id: str, inputs: dict, request_type: str,
                       token_address: str) -> str:
        outputs = await self._exec("generation", request_id, inputs,
                                   _parameters(request_type, token_address))
        return _control_address(outputs)


class GrpcTransport:
    """tritonclient.grpc.aio clients, created lazily on the loop that uses them."""

    def __init__(self, context_url: str | None, generation_url: str):
        self.urls = {"context": context_url, "generation": generation_url}
        self.clients: dict[str, Any] = {}

    def _client(self, model: str) -> Any:
        if model not in self.clients:
            import tritonclient.grpc.aio as grpcclient

            self.clients[model] = grpcclient.InferenceServerClient(self.urls[model])
        return self.clients[model]

    async def _infer(self, model: str, request_id: str, inputs: dict,
                     parameters: dict[str, str]) -> dict[str, np.ndarray]:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        specs, outputs = _SPECS[model]
        tensors = []
        for name, arr in to_batched(specs, inputs).items():
            tensors.append(grpcclient.InferInput(name, list(arr.shape), P.by_name(specs)[name].dtype))
            tensors[-1].set_data_from_numpy(arr)
        try:
            result = await self._client(model).infer(model, tensors, request_id=request_id,
                                                     parameters=parameters)
        except InferenceServerException as exc:
            error = _error(model, exc.message())
            raise type(error)(f"{model} at {self.urls[model]}: {error}") from None
        arrays = {s.name: result.as_numpy(s.name) for s in outputs}
        return _unbatch({n: a for n, a in arrays.items() if a is not None})

    async def context(self, request_id: str, inputs: dict) -> dict[str, np.ndarray]:
        return await self._infer("context", request_id, inputs, _parameters(P.CONTEXT_ONLY, None))

    async def release(self, request_id: str, inputs: dict, handle: np.ndarray) -> None:
        await self._infer("context", request_id, _release_inputs(inputs, handle),
                        _parameters(P.RELEASE_KV, None))

    async def generate(self, request_id: str, inputs: dict, request_type: str,
                       token_address: str) -> str:
        outputs = await self._infer("generation", request_id, inputs,
                                    _parameters(request_type, token_address))
        return _control_address(outputs)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()

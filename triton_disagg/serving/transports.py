"""How the orchestrator reaches context and generation: in-process BLS or tritonclient gRPC.

Both implement :class:`triton_disagg.serving.orchestrator.Transport` and move
the tensors of :data:`protocol.ENGINE_INPUTS` / ``ENGINE_OUTPUTS`` unchanged
(batch axis of 1 added on the way out, removed on the way back), with the
phase in the ``request_type`` request parameter and the orchestrator's request
id as the Triton request id, which the generation stop path names.

BLS facts (Triton 2.51): ``await InferenceRequest.async_exec(decoupled=True)``
returns a *blocking* iterator, pulled here on a thread pool sized for the
expected concurrency so the event loop never stalls; a BLS caller cannot
cancel the request it sent, hence :meth:`stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

import numpy as np

from triton_disagg import protocol as P
from triton_disagg.serving.engine_request import merge_outputs
from triton_disagg.serving.orchestrator import EngineError
from triton_disagg.serving.tensors import to_batched

_OUTPUT_NAMES = {"context": [s.name for s in P.CONTEXT_OUTPUTS],
                 "generation": [s.name for s in P.GENERATION_OUTPUTS]}
# A stop request still carries the required inputs; their values are ignored.
STOP_INPUTS = {"input_ids": np.array([0], dtype=np.int32), "input_lengths": np.array([1], np.int32),
               "request_output_len": np.array([1], np.int32), P.STOP: np.array([True])}


def _unbatch(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: arr[0] for name, arr in arrays.items()}


class BLSTransport:
    def __init__(self, pb_utils: Any, max_concurrency: int = 256):
        self.pb = pb_utils
        self.executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="bls-stream")

    def _request(self, model: str, request_id: str, inputs: dict, request_type: str | None) -> Any:
        specs = P.CONTEXT_INPUTS if model == "context" else P.GENERATION_INPUTS
        tensors = [self.pb.Tensor(n, a) for n, a in to_batched(specs, inputs).items()]
        params = {P.REQUEST_TYPE: request_type} if request_type else {}
        return self.pb.InferenceRequest(model_name=model, inputs=tensors, request_id=request_id,
                                        requested_output_names=_OUTPUT_NAMES[model],
                                        parameters=params)

    def _outputs(self, response: Any) -> dict[str, np.ndarray]:
        if response.has_error():
            raise EngineError(response.error().message())
        return _unbatch({t.name(): t.as_numpy() for t in response.output_tensors()})

    async def context(self, request_id: str, inputs: dict) -> dict[str, np.ndarray]:
        response = await self._request("context", request_id, inputs, P.CONTEXT_ONLY).async_exec()
        return self._outputs(response)

    async def generate(self, request_id: str, inputs: dict,
                       request_type: str) -> AsyncIterator[dict[str, np.ndarray]]:
        """Each response, or every response that arrived meanwhile merged into one
        (:func:`engine_request.merge_outputs`: same tokens, in order, fewer sends downstream)."""
        request = self._request("generation", request_id, inputs, request_type)
        iterator = await request.async_exec(decoupled=True)
        loop = asyncio.get_running_loop()
        arrived: asyncio.Queue = asyncio.Queue()

        def pump() -> None:    # one pool thread drains the blocking iterator; one hop per response
            try:
                for response in iterator:
                    loop.call_soon_threadsafe(arrived.put_nowait, response)
                item = None
            except Exception as exc:  # noqa: BLE001 - handed to the coroutine, raised there
                item = exc
            with contextlib.suppress(RuntimeError):         # the loop is gone: nobody listens
                loop.call_soon_threadsafe(arrived.put_nowait, item)

        self.executor.submit(pump)
        while True:
            batch = [await arrived.get()]
            while not arrived.empty():
                batch.append(arrived.get_nowait())
            merged = None
            for item in batch:
                if item is None or isinstance(item, Exception) or item.has_error():
                    if merged is not None:
                        yield merged
                    if item is None:
                        return
                    if isinstance(item, Exception):
                        raise EngineError(f"generation stream failed: {item}")
                    self._outputs(item)                       # raises the response's error
                outputs = self._outputs(item)
                if outputs:                     # a flags-only final response has no tensors
                    merged = outputs if merged is None else merge_outputs(merged, outputs)
            if merged is not None:
                yield merged

    async def stop(self, request_id: str) -> None:
        iterator = await self._request("generation", request_id, STOP_INPUTS, None).async_exec(
            decoupled=True)
        await asyncio.get_running_loop().run_in_executor(self.executor, list, iterator)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


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

    @staticmethod
    def _inputs(model: str, inputs: dict) -> list:
        import tritonclient.grpc as grpcclient

        specs = P.CONTEXT_INPUTS if model == "context" else P.GENERATION_INPUTS
        out = []
        for name, arr in to_batched(specs, inputs).items():
            tensor = grpcclient.InferInput(name, list(arr.shape), P.by_name(specs)[name].dtype)
            tensor.set_data_from_numpy(arr)
            out.append(tensor)
        return out

    @staticmethod
    def _outputs(result: Any, model: str) -> dict[str, np.ndarray]:
        arrays = {n: result.as_numpy(n) for n in _OUTPUT_NAMES[model]}
        return _unbatch({n: a for n, a in arrays.items() if a is not None})

    async def context(self, request_id: str, inputs: dict) -> dict[str, np.ndarray]:
        from tritonclient.utils import InferenceServerException

        try:
            result = await self._client("context").infer(
                "context", self._inputs("context", inputs), request_id=request_id,
                parameters={P.REQUEST_TYPE: P.CONTEXT_ONLY})
        except InferenceServerException as exc:
            raise EngineError(f"context at {self.urls['context']}: {exc.message()}") from None
        return self._outputs(result, "context")

    async def generate(self, request_id: str, inputs: dict,
                       request_type: str | None) -> AsyncIterator[dict[str, np.ndarray]]:
        request = {"model_name": "generation", "inputs": self._inputs("generation", inputs),
                   "request_id": request_id}
        if request_type:
            request["parameters"] = {P.REQUEST_TYPE: request_type}

        async def one_request():
            yield request

        stream = self._client("generation").stream_infer(one_request())
        try:
            async for result, error in stream:
                if error is not None:
                    raise EngineError(f"generation at {self.urls['generation']}: {error.message()}")
                outputs = self._outputs(result, "generation")
                if outputs:
                    yield outputs
        finally:
            stream.cancel()

    async def stop(self, request_id: str) -> None:
        async for _ in self.generate(request_id, STOP_INPUTS, None):
            break

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()

"""The HTTP front's one call: a request to the ``orchestrator`` model over Triton's gRPC
streaming (tritonclient's asyncio client), its responses as text deltas.

Why the orchestrator and not the ensemble: a client's cancel reaches a decoupled model it
calls directly, but not the steps inside an ensemble (Triton 2.51), and the orchestrator
must see it to stop generation and free the request's KV blocks. Preprocessing runs in the
front itself, on the same library (:mod:`.prepare`).

Invariants: one gRPC stream per request, half-closed once the request is sent, so it ends
when the orchestrator sends its final response; a stream that ends any other way (the
caller stops iterating: the HTTP client left, or its task was cancelled) is cancelled, and
Triton passes that cancel to the orchestrator; an error response raises
:class:`OrchestratorError` with the orchestrator's message and the HTTP status it means
(a timeout 504, a server missing 503, else 500).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np

from triton_disagg.config.tls_section import GrpcTLS
from triton_disagg.errors import Timeout
from triton_disagg.front.health import ServerReadiness
from triton_disagg.triton.grpc_channel import client_options

ORCHESTRATOR = "orchestrator"
# Words in an orchestrator error that say the deployment, not the request, is at fault now.
_UNAVAILABLE = ("lost", "no ", "not ready", "unavailable", "busy", "stall")


@dataclass(frozen=True)
class Delta:
    """One orchestrator response: its text, the running counts, and (only when the request
    asked for log-probs) the ids of its tokens and their log-probs, in step."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: tuple[int, ...] = ()
    log_probs: tuple[float, ...] = ()


class OrchestratorError(Exception):
    """The orchestrator answered with an error: 504 when a server let its deadline pass
    (:class:`~triton_disagg.errors.Timeout`: the message says so), 503 when a server is
    missing or busy, else 500."""

    def __init__(self, message: str):
        super().__init__(message)
        lowered = message.lower()
        self.status = (504 if Timeout.MARK in lowered else
                       503 if any(word in lowered for word in _UNAVAILABLE) else 500)


class Relay:
    """A tritonclient asyncio gRPC client to the server at ``url`` (``host:port``); it is
    ready while the server and ``models`` (the orchestrator among them) are."""

    def __init__(self, url: str, models: tuple[str, ...] = (ORCHESTRATOR,),
                 tls: GrpcTLS | None = None):
        import tritonclient.grpc.aio as grpcclient

        self.client = grpcclient.InferenceServerClient(url, **client_options(tls))
        with_orchestrator = tuple(dict.fromkeys((ORCHESTRATOR, *models)))   # once, first
        self.readiness = ServerReadiness(self.client, with_orchestrator)

    async def ready(self) -> str | None:
        """None when the server and its models are ready, else why not
        (:class:`~triton_disagg.front.health.ServerReadiness`)."""
        return await self.readiness.ready()

    async def stream(self, inputs: dict[str, np.ndarray], request_id: str) -> AsyncIterator[Delta]:
        """The orchestrator's responses to ``inputs`` (arrays with their batch axis)."""
        from tritonclient.grpc import InferInput
        from tritonclient.utils import np_to_triton_dtype

        tensors = []
        for name, array in inputs.items():
            tensors.append(InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype)))
            tensors[-1].set_data_from_numpy(array)

        async def one_request():
            yield {"model_name": ORCHESTRATOR, "inputs": tensors, "request_id": request_id}

        responses = self.client.stream_infer(one_request())
        ended = False
        try:
            async for result, error in responses:
                if error is not None:
                    raise OrchestratorError(error.message())
                yield _delta(result)
            ended = True
        finally:
            if not ended:
                responses.cancel()

    async def close(self) -> None:
        await self.client.close()


def _delta(result) -> Delta:
    """A tritonclient ``InferResult`` of the orchestrator -> its :class:`Delta`."""
    text = result.as_numpy("text_output")
    n_in, n_out = result.as_numpy("num_input_tokens"), result.as_numpy("num_output_tokens")
    ids, lps = result.as_numpy("output_ids"), result.as_numpy("output_log_probs")
    return Delta(text.reshape(-1)[0].decode("utf-8") if text is not None else "",
                 int(n_in.reshape(-1)[0]) if n_in is not None else 0,
                 int(n_out.reshape(-1)[0]) if n_out is not None else 0,
                 tuple(ids.reshape(-1).tolist()) if ids is not None else (),     # [1, 1, n] -> [n]
                 tuple(lps.reshape(-1).tolist()) if lps is not None else ())


def unreachable(exc: Exception) -> bool:
    """True for the errors of a call that did not reach tritonserver or lost it (gRPC's own,
    the client's, the OS's), as opposed to a fault of this process."""
    import grpc
    from tritonclient.utils import InferenceServerException

    return isinstance(exc, (grpc.aio.AioRpcError, InferenceServerException, OSError))

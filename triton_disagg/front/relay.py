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
:class:`OrchestratorError` with the orchestrator's message and its
:class:`~triton_disagg.errors.ErrorCode`, once the stream has ended as usual. A Triton
stream's error message carries no status, so the request asks the orchestrator for the code
in the message (the request parameter :data:`~triton_disagg.errors.CODE_IN_MESSAGE`; read
back by :func:`~triton_disagg.errors.code_in`). An error without that tag is Triton's own
(the orchestrator tags every one it sends: e.g. the orchestrator model unknown, not loaded
or unloading): UNAVAILABLE when Triton then says the models are not ready, else INTERNAL
(a malformed request is this front's fault). Not Triton's ``triton_grpc_error`` header,
which ends the stream with the error's status instead: in Triton 2.51 that path closes the
stream from the response callback's thread, logs "HandleCancellation called even when the
context was not cancelled" for each error, and once crashed tritonserver (SIGSEGV) right
after it; Triton fixed a use-after-free of that mode later (server PR #8708).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np

from triton_disagg.config.tls_section import GrpcTLS
from triton_disagg.engine.logprobs import TopLogprobs
from triton_disagg.engine.prompt_logprobs import PromptLogprobs
from triton_disagg.errors import CODE_IN_MESSAGE, HTTP_STATUS, ErrorCode, code_in, \
    from_grpc_status, without_tag
from triton_disagg.front.engine_calls import top_rows
from triton_disagg.front.health import ServerReadiness
from triton_disagg.protocol import FINISH_REASONS, TOP_LOGPROBS, FinishReason
from triton_disagg.triton.grpc_channel import client_options

ORCHESTRATOR = "orchestrator"


@dataclass(frozen=True)
class Delta:
    """One orchestrator response: its text, the running counts, (only when the request
    asked for log-probs) the ids of its tokens and their log-probs, in step (and each one's
    alternatives when it asked for ``top_logprobs``), and (the final response only) why the
    request ended."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: tuple[int, ...] = ()
    log_probs: tuple[float, ...] = ()
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0            # of prompt_tokens, served from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None   # the first response's, when asked
    top: tuple[TopLogprobs, ...] = ()                # one per token id, when asked


class OrchestratorError(Exception):
    """The orchestrator answered with an error of ``code``; ``status``: the HTTP status that
    code means (:data:`~triton_disagg.errors.HTTP_STATUS`: INVALID_ARG 400, UNAVAILABLE 503,
    TIMEOUT 504, INTERNAL 500)."""

    def __init__(self, message: str, code: ErrorCode):
        super().__init__(message)
        self.code, self.status = code, HTTP_STATUS[code]

    @classmethod
    def from_status(cls, status: str, message: str) -> "OrchestratorError":
        """The error of a gRPC ``status`` ("StatusCode.UNAVAILABLE", as tritonclient names
        it) and its ``message``: a stream Triton itself ended (e.g. no such model)."""
        return cls(without_tag(message), from_grpc_status(status, message))


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
        import grpc
        from tritonclient.grpc import InferInput
        from tritonclient.utils import np_to_triton_dtype

        tensors = []
        for name, array in inputs.items():
            tensors.append(InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype)))
            tensors[-1].set_data_from_numpy(array)

        async def one_request():
            yield {"model_name": ORCHESTRATOR, "inputs": tensors, "request_id": request_id,
                   "parameters": {CODE_IN_MESSAGE: True}}

        responses = self.client.stream_infer(one_request())
        ended, failed = False, None      # failed: the stream's error, raised once it ended
        try:
            async for result, error in responses:
                if error is not None:          # the final response: the stream ends next
                    failed = failed or await self._failure(error.message())
                elif failed is None:
                    yield _delta(result)
            ended = True
        except grpc.aio.AioRpcError as exc:
            ended = True                        # Triton ended the stream with a status
            raise OrchestratorError.from_status(str(exc.code()), exc.details() or "") from None
        finally:
            if not ended:
                responses.cancel()
        if failed is not None:
            raise failed

    async def _failure(self, message: str) -> OrchestratorError:
        """The error of a stream's error ``message``: its code tagged in it
        (:func:`~triton_disagg.errors.code_in`), else Triton's own error, UNAVAILABLE while
        the models are not ready and INTERNAL when they are."""
        code, text = code_in(message)
        if code is None:
            code = ErrorCode.INTERNAL if await self.ready() is None else ErrorCode.UNAVAILABLE
        return OrchestratorError(text, code)

    async def close(self) -> None:
        await self.client.close()


def _delta(result) -> Delta:
    """A tritonclient ``InferResult`` of the orchestrator -> its :class:`Delta`."""
    text = result.as_numpy("text_output")
    n_in, n_out = result.as_numpy("num_input_tokens"), result.as_numpy("num_output_tokens")
    ids, lps = result.as_numpy("output_ids"), result.as_numpy("output_log_probs")
    cached = result.as_numpy("num_cached_tokens")
    reason = result.as_numpy("finish_reason")
    reason = reason.reshape(-1)[0].decode("utf-8") if reason is not None else None   # [1, 1]
    token_ids = tuple(ids.reshape(-1).tolist()) if ids is not None else ()     # [1, 1, n] -> [n]
    top = top_rows({s.name: result.as_numpy(s.name) for s in TOP_LOGPROBS}, len(token_ids))
    return Delta(text.reshape(-1)[0].decode("utf-8") if text is not None else "",
                 int(n_in.reshape(-1)[0]) if n_in is not None else 0,
                 int(n_out.reshape(-1)[0]) if n_out is not None else 0,
                 token_ids, tuple(lps.reshape(-1).tolist()) if lps is not None else (),
                 reason if reason in FINISH_REASONS else None,
                 int(cached.reshape(-1)[0]) if cached is not None else 0,
                 _prompt_logprobs(result), tuple(top or ()))


def _prompt_logprobs(result) -> PromptLogprobs | None:
    """The ``PROMPT_LOGPROBS`` tensors of a response, position 0's empty row dropped."""
    chosen = result.as_numpy("prompt_log_probs")
    ids, top = result.as_numpy("prompt_top_ids"), result.as_numpy("prompt_top_log_probs")
    if chosen is None or ids is None or top is None:
        return None
    k = ids.shape[-1]
    return PromptLogprobs(chosen.reshape(-1)[1:],                  # [1, n] -> [n-1]
                          ids.reshape(-1, k)[1:], top.reshape(-1, k)[1:])   # [1, n, k] -> [n-1, k]


def unreachable(exc: Exception) -> bool:
    """True for the errors of a call that did not reach tritonserver or lost it (gRPC's own,
    the client's, the OS's), as opposed to a fault of this process."""
    import grpc
    from tritonclient.utils import InferenceServerException

    return isinstance(exc, (grpc.aio.AioRpcError, InferenceServerException, OSError))

"""How the orchestrator reaches context and generation: in-process BLS or tritonclient gRPC.

Both implement :class:`triton_disagg.front.orchestrator.Transport`: ``route`` gives a
request's :class:`~triton_disagg.front.orchestrator.Route`, whose calls move the tensors
of :data:`protocol.ENGINE_INPUTS` / ``CONTEXT_OUTPUTS`` unchanged (batch axis of 1 added
on the way out, removed on the way back), with the phase in the ``request_type`` request
parameter, the deployment's credential in ``peer_credential`` (:mod:`triton_disagg.peers`:
context and generation answer no one else) and the orchestrator's request id as the Triton
request id. A generation request also names the orchestrator's token address
(``token_address``); Triton carries it to generation, whose one response is the control
address for stops: the tokens themselves arrive over ZeroMQ (:mod:`token_inbox`), never as
Triton responses. A callee's error answer is raised as the error class of its status
(:class:`~triton_disagg.errors.ErrorCode`: BLS ``TritonError.code()``, gRPC status), never
by its message.

Deadlines: a route's context and generation calls each wait at most its ``timeout`` (the
orchestrator's ``generation_server.stall_seconds``), a release at most
``RELEASE_TIMEOUT_SECONDS``: over gRPC as the call's deadline, in ``serve all`` as a wait on
the BLS call. A context call also carries it as the Triton request's timeout: how long the
context keeps it queued while its KV pool is full (:mod:`triton_disagg.context.prefill_loop`).

This module holds what both share and the BLS transport (``serve all``); the gRPC one
(``serve scheduler``) is :mod:`.grpc_transport`.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any
# Any here: Triton's pb_utils module and its objects, which have no types.

import numpy as np

from triton_disagg import peers, protocol as P
from triton_disagg.errors import ErrorCode, Timeout, error_for, from_triton, without_tag
from triton_disagg.front.token_inbox import GenerationAnswer
from triton_disagg.triton.tensors import to_batched

CALL_TIMEOUT_SECONDS = 30.0    # a route's deadline when none is given (stall_seconds' default)
RELEASE_TIMEOUT_SECONDS = 5.0  # a release not answered by then: the lease reclaims the KV
CALL_SPECS = {"context": (P.CONTEXT_INPUTS, P.CONTEXT_OUTPUTS),
          "generation": (P.GENERATION_INPUTS, P.GENERATION_OUTPUTS)}


def unbatch(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: arr[0] for name, arr in arrays.items()}


def call_parameters(credential: str, request_type: str,
                token_address: str | None = None) -> dict[str, str]:
    params = {P.REQUEST_TYPE: request_type, peers.PARAMETER: credential}
    if token_address is not None:
        params[P.TOKEN_ADDRESS] = token_address
    return params


def callee_error(code: ErrorCode, message: str) -> Exception:
    """The callee's error answer as ours, by its ``code`` (:func:`errors.error_for`: an
    INVALID_ARG is the request's own mistake, passed on as one)."""
    return error_for(code, without_tag(message))


def _bls_code(pb_utils: Any, error: Any) -> ErrorCode:
    """The code of a BLS response's ``pb_utils.TritonError`` (by its ``code()``)."""
    name = next((c.value for c in ErrorCode
                 if getattr(pb_utils.TritonError, c.value, None) == error.code()),
                ErrorCode.INTERNAL.value)
    return from_triton(name, error.message())


def microseconds(seconds: float) -> int:
    """A Triton request timeout (microseconds) of ``seconds``."""
    return int(seconds * 1e6)


def release_inputs(inputs: dict, handle: np.ndarray) -> dict:
    return dict(inputs, **{P.CONTEXT_PHASE_PARAMS: handle})


def generation_answer(outputs: dict[str, np.ndarray]) -> GenerationAnswer:
    """Generation's answer read from its response tensors."""
    value = np.asarray(outputs[P.CONTROL_ADDRESS]).reshape(-1)[0]     # [1] -> scalar
    listener = outputs.get(P.KV_LISTENER)
    return GenerationAnswer(value.decode() if isinstance(value, bytes) else str(value),
                            b"" if listener is None else np.asarray(listener, np.uint8).tobytes())


class BLSTransport:
    """``serve all``'s calls, in this server. The stub's ``async_exec`` runs each call in a
    thread of the event loop's default executor until it is answered, and a context call
    waits in the context's queue while its pool is full: so that such calls never hold
    every thread while the generation calls that would free that pool queue behind them,
    the loop's default executor gets a thread for each of ``max_calls`` calls out at once
    (made on first use; idle ones cost nothing)."""

    def __init__(self, pb_utils: Any, max_calls: int):
        self.pb = pb_utils
        self.credential = peers.credential()
        self.max_calls = max_calls
        self.executors: set[asyncio.AbstractEventLoop] = set()   # loops whose executor is set

    def executor_for(self, loop: asyncio.AbstractEventLoop) -> None:
        """Give ``loop`` a default executor of ``max_calls`` threads (once per loop)."""
        if loop not in self.executors:
            loop.set_default_executor(ThreadPoolExecutor(self.max_calls, "bls-call"))
            self.executors.add(loop)

    def route(self, request_id: str, avoid: frozenset[str] = frozenset(),
              timeout: float = CALL_TIMEOUT_SECONDS) -> "BLSRoute":
        """Generation is this server's own model: never lost, so nothing to avoid."""
        return BLSRoute(self, request_id, timeout)


class BLSRoute:
    """One request's calls to the context and generation models of this server, each
    waited for at most ``timeout`` seconds (a release: ``RELEASE_TIMEOUT_SECONDS``)."""

    cancellable = False      # the stub's async_exec runs to its answer once sent

    def __init__(self, transport: BLSTransport, request_id: str, timeout: float):
        self.transport, self.pb, self.credential = transport, transport.pb, transport.credential
        self.request_id, self.timeout = request_id, timeout

    async def _exec(self, model: str, inputs: dict, parameters: dict[str, str],
                    timeout: float, queue_timeout: float = 0.0) -> dict[str, np.ndarray]:
        """``queue_timeout``: the Triton request's timeout (0: none)."""
        specs, outputs = CALL_SPECS[model]
        tensors = [self.pb.Tensor(n, a) for n, a in to_batched(specs, inputs).items()]
        request = self.pb.InferenceRequest(
            model_name=model, inputs=tensors, request_id=self.request_id,
            requested_output_names=[s.name for s in outputs], parameters=parameters,
            timeout=microseconds(queue_timeout))
        self.transport.executor_for(asyncio.get_running_loop())
        try:
            response = await asyncio.wait_for(request.async_exec(), timeout)
        except asyncio.TimeoutError:
            raise Timeout(f"{model} timed out: no answer within {timeout:g} s") from None
        if response.has_error():
            error = response.error()
            raise callee_error(_bls_code(self.pb, error), error.message())
        return unbatch({t.name(): t.as_numpy() for t in response.output_tensors()})

    async def context(self, inputs: dict) -> dict[str, np.ndarray]:
        return await self._exec("context", inputs, call_parameters(self.credential, P.CONTEXT_ONLY),
                                self.timeout, queue_timeout=self.timeout)

    async def release(self, inputs: dict, handle: np.ndarray) -> None:
        await self._exec("context", release_inputs(inputs, handle),
                         call_parameters(self.credential, P.RELEASE_KV),
                         min(self.timeout, RELEASE_TIMEOUT_SECONDS))

    async def generate(self, inputs: dict, request_type: str,
                       token_address: str) -> GenerationAnswer:
        outputs = await self._exec("generation", inputs,
                                   call_parameters(self.credential, request_type, token_address),
                                   self.timeout)
        return generation_answer(outputs)

    async def lost(self) -> None:
        """Generation runs in this server: if it died, so did the orchestrator."""
        return None

    def close(self) -> None:
        pass

"""The orchestrator's calls to its engines (the context and generation models): which
requests may make them (:class:`OrchestratorGate`, :class:`InFlightCap`), what a request's
calls carry (:func:`call_inputs`), how they travel (in-process BLS here,
tritonclient gRPC in :mod:`.grpc_transport`), their answers read back (the context's as the
request's first token event, :func:`~triton_disagg.triton.tensors.engine_event`; generation's,
:func:`generation_answer`), and token events turned into the ensemble's outputs
(:class:`ResponseBuilder`; its
invariant: streamed ``text_output`` deltas concatenate to the non-streamed text,
multi-byte characters included, :func:`~triton_disagg.front.tokenizer.text_delta`).

Transports: both implement :class:`triton_disagg.front.orchestrator.Transport`: ``route``
gives a request's :class:`~triton_disagg.front.orchestrator.Route`, whose calls take the
request as the :class:`~triton_disagg.engine.sequence.EngineRequest` the gate read from the
orchestrator's inputs (its one form from there to the engines) and move it as the tensors of
:data:`protocol.ENGINE_INPUTS` (:func:`call_inputs`: made there alone), the answers as
``CONTEXT_OUTPUTS`` (batch axis of 1 added on the way out, removed on the way back), with
the phase in the ``request_type`` request
parameter, the deployment's credential in ``peer_credential``
(:func:`~triton_disagg.triton.tensors.peer_credential`: context and generation answer no one
else) and the orchestrator's request id as the Triton
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

Admission: a request is admitted only when its preprocessed tensors carry their seal
(:func:`~triton_disagg.triton.tensors.check_seal`: it came from this deployment's preprocessing,
through the ensemble or the HTTP front), and, defence in depth, only when every input is
within the engine's limits as context and generation check them
(:func:`triton_disagg.triton.tensors.from_inputs`) and ``input_ids`` plus
``request_output_len`` fit ``max_seq_len``. An error answer to the client names its own
mistake (:class:`RequestError`) but never a server's: an engine error or a fault is logged
in full with the request id, and the client gets its kind and that id
(:func:`public_message`), no internal URL and no exception text.

This module holds what both transports share and the BLS transport (``serve all``); the
gRPC one (``serve scheduler``) is :mod:`.grpc_transport`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence
# Any here: Triton's pb_utils module and its objects, which have no types.

import numpy as np

from triton_disagg import protocol as P
from triton_disagg.engine.sequence import EngineRequest, TokenEvent
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.front.tokenizer import DeltaWindows, text_delta
from triton_disagg.errors import (EngineError, ErrorCode, RequestError, ServerBusy, Timeout,
                                  Unavailable, error_for, from_triton, without_tag)
from triton_disagg.front.token_inbox import GenerationAnswer
from triton_disagg.triton.tensors import (check_seal, engine_tensors, from_inputs,
                                          peer_credential, response_outputs, scalar,
                                          to_batched)

CALL_TIMEOUT_SECONDS = 30.0    # a route's deadline when none is given (stall_seconds' default)
RELEASE_TIMEOUT_SECONDS = 5.0  # a release not answered by then: the lease reclaims the KV
CALL_SPECS = {"context": (P.CONTEXT_INPUTS, P.CONTEXT_OUTPUTS),
          "generation": (P.GENERATION_INPUTS, P.GENERATION_OUTPUTS)}
# error class -> what the client is told (the first that the error is an instance of); the
# error's status goes with it (ErrorCode): the HTTP front maps that, not these words
_PUBLIC = ((Timeout, "a server did not answer in time (timed out)"),
           (ServerBusy, "this server is busy with its most requests at once; retry later"),
           (Unavailable, "a server this request needs is unavailable now; retry later"))


def unbatch(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: arr[0] for name, arr in arrays.items()}


def call_parameters(credential: str, request_type: str,
                token_address: str | None = None) -> dict[str, str]:
    params = {P.REQUEST_TYPE: request_type, P.PEER_CREDENTIAL: credential}
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


def call_inputs(request: EngineRequest, handle: bytes = b"",
                listener: bytes = b"") -> dict[str, np.ndarray]:
    """A call's inputs: ``request`` as ``ENGINE_INPUTS`` (:func:`engine_tensors`), with the
    prompt's KV ``handle`` (``context_phase_params``: a ``generation_only`` call or a
    release) or generation's ``listener`` (``kv_listener``: an overlapped context call)."""
    out = engine_tensors(request)
    if handle:
        out[P.CONTEXT_PHASE_PARAMS] = np.frombuffer(handle, np.uint8)
    if listener:
        out[P.KV_LISTENER] = np.frombuffer(listener, np.uint8)
    return out


def handle_of(outputs: dict[str, np.ndarray], needed: bool = False) -> bytes:
    """The KV handle (``context_phase_params``) in the context's answer; b"": none, unless
    ``needed`` (a handoff): then a context that answered without one is a server's fault."""
    handle = outputs.get(P.CONTEXT_PHASE_PARAMS)
    handle = b"" if handle is None else np.asarray(handle, np.uint8).tobytes()
    if needed and not handle:
        raise EngineError("the context answered without context_phase_params (its KV handle)")
    return handle


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
    (made on first use; idle ones cost nothing). Context calls take ``context_models`` (one
    per context instance: :func:`~triton_disagg.config.roles.instance_models`) in turn, as
    Triton spread them over one model's instances; a request's release goes to the model
    that holds its KV."""

    def __init__(self, pb_utils: Any, max_calls: int,
                 context_models: tuple[str, ...] = ("context",)):
        self.pb = pb_utils
        self.credential = peer_credential()
        self.max_calls = max_calls
        self.executors: set[asyncio.AbstractEventLoop] = set()   # loops whose executor is set
        self._context_models = itertools.cycle(context_models)

    def next_context_model(self) -> str:
        """The context model a request's context call goes to: each in turn."""
        return next(self._context_models)

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
        self.context_model = "context"      # the model its context call went to

    async def _exec(self, role: str, inputs: dict, parameters: dict[str, str],
                    timeout: float, queue_timeout: float = 0.0,
                    model: str | None = None) -> dict[str, np.ndarray]:
        """A call of ``role`` to ``model`` (None: the role's own); ``queue_timeout``: the
        Triton request's timeout (0: none)."""
        specs, outputs = CALL_SPECS[role]
        model = model or role
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

    async def context(self, request: EngineRequest,
                      listener: bytes = b"") -> dict[str, np.ndarray]:
        self.context_model = self.transport.next_context_model()
        return await self._exec("context", call_inputs(request, listener=listener),
                                call_parameters(self.credential, P.CONTEXT_ONLY),
                                self.timeout, queue_timeout=self.timeout, model=self.context_model)

    async def release(self, request: EngineRequest, handle: bytes) -> None:
        await self._exec("context", call_inputs(request, handle=handle),
                         call_parameters(self.credential, P.RELEASE_KV),
                         min(self.timeout, RELEASE_TIMEOUT_SECONDS), model=self.context_model)

    async def generate(self, request: EngineRequest, request_type: str, token_address: str,
                       handle: bytes = b"") -> GenerationAnswer:
        outputs = await self._exec("generation", call_inputs(request, handle=handle),
                                   call_parameters(self.credential, request_type, token_address),
                                   self.timeout)
        return generation_answer(outputs)

    async def lost(self) -> None:
        """Generation runs in this server: if it died, so did the orchestrator."""
        return None

    def close(self) -> None:
        pass


# ---- which requests may call: the orchestrator's admission, and its error answers

class InFlightCap:
    """At most ``limit`` requests of one orchestrator instance in flight: a :meth:`slot` past
    it raises :class:`ServerBusy` at once (nothing queues behind the cap); a slot is held
    for its ``with`` block, however it ends. One event loop uses it: nothing locks."""

    def __init__(self, limit: int):
        self.limit, self.in_flight = limit, 0

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        if self.in_flight >= self.limit:
            raise ServerBusy(f"{self.in_flight} requests in flight, the most this orchestrator "
                             f"instance takes (scheduler_server.max_concurrent_requests)")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1


class OrchestratorGate:
    """``seal_key``: :func:`~triton_disagg.triton.tensors.seal_key`; ``spec``: the served
    engine's."""

    def __init__(self, seal_key: bytes, spec: EngineSpec):
        self.seal_key, self.spec = seal_key, spec

    def check(self, inputs: dict[str, np.ndarray]) -> EngineRequest:
        """The engine request ``inputs`` hold, ``streaming`` set (generation streams to the
        orchestrator whatever the client asked); :class:`RequestError` unless the
        orchestrator may serve it."""
        check_seal(inputs, self.seal_key)
        request = from_inputs(engine_inputs(inputs), self.spec)
        total = len(request.prompt_ids) + request.params.max_tokens
        if total > self.spec.max_seq_len:
            raise RequestError(f"prompt ({len(request.prompt_ids)} tokens) + request_output_len "
                               f"exceeds this engine's max_seq_len {self.spec.max_seq_len}")
        return request


def public_message(exc: Exception, request_id: str) -> str:
    """What the client is told of ``exc``: a request's own mistake as it is, anything else
    by its kind and ``request_id`` (the server log has the rest)."""
    if isinstance(exc, RequestError):
        return str(exc)
    kind = next((text for cls, text in _PUBLIC if isinstance(exc, cls)),
                "internal error; the request failed")
    return f"{kind} (request {request_id}; the server log says why)"


# ---- what the calls carry, and their answers as the ensemble's outputs

def engine_inputs(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Orchestrator inputs -> ``ENGINE_INPUTS`` (present ones only): what the gate reads the
    engine request from."""
    names = {s.name for s in P.ENGINE_INPUTS}
    out = {n: v for n, v in inputs.items() if n in names}
    out.update({P.SAMPLING_TO_ENGINE[n]: v for n, v in inputs.items() if n in P.SAMPLING_TO_ENGINE})
    out["streaming"] = np.array([True])   # the orchestrator always streams from generation
    return out


class ResponseBuilder:
    """Turns a request's events into the orchestrator's responses: events with their text
    (``text_output`` deltas), the counts and, on the final one, ``finish_reason``; log-probs
    only when the request's ``return_log_probs`` asked for them, as TensorRT-LLM does (each
    tensor costs the stub a shared-memory copy per response), and with them the tokens'
    ids and (the request's ``top_logprobs``) their alternatives. Out as tensors by
    :func:`~triton_disagg.triton.tensors.response_outputs`."""

    def __init__(self, inputs: dict[str, np.ndarray], decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.prompt = np.asarray(inputs["input_ids"]).reshape(-1).tolist()
        self.end_id = scalar(inputs, "end_id", -1)
        self.stream = bool(scalar(inputs, "stream", False))
        exclude = bool(scalar(inputs, "exclude_input_in_output", True))
        self.windows = DeltaWindows(() if exclude or self.stream else self.prompt)
        self.return_log_probs = bool(scalar(inputs, "return_log_probs", False))
        self.generated = 0
        self.cached_tokens = 0          # the context's answer says (:meth:`context_answered`)
        self.prompt_logprobs: dict[str, np.ndarray] = {}    # until the first response
        self.cum_log_prob = 0.0
        self.pending: list[TokenEvent] = []     # events not yet in a response

    def context_answered(self, out: dict[str, np.ndarray]) -> None:
        """Note how many prompt tokens the context served from its prefix cache, and the
        prompt's log-probs when it computed them (they go out with the first response, the
        context's tensors as they came)."""
        self.cached_tokens = int(scalar(out, P.NUM_CACHED_TOKENS, 0))
        self.prompt_logprobs = {s.name: out[s.name] for s in P.PROMPT_LOGPROBS if s.name in out}

    def add(self, event: TokenEvent) -> dict | None:
        """Outputs to send now (streaming) or None (accumulating until the final event, which
        carries no error: those are raised before they get here)."""
        if event.final and event.tokens and event.tokens[-1] == self.end_id:
            event = event.without_last()        # the end token is not output text
        self.generated += len(event.tokens)
        self.cum_log_prob += float(sum(event.log_probs or ()))
        if not (self.stream or event.final):
            self.pending.append(event)
            return None
        if self.pending:
            event = TokenEvent.joined(self.pending + [event])
            self.pending = []
        return self._outputs(event)

    def _outputs(self, event: TokenEvent) -> dict:
        """The outputs of ``event``'s tokens (its finish reason: the final response's)."""
        ids, top, final = event.tokens, event.top, event.final
        window, offset = self.windows.next(ids)
        log_probs = None
        if self.return_log_probs:
            log_probs = event.log_probs if event.log_probs is not None else [0.0] * len(ids)
        out = response_outputs(TokenEvent(
            event.request_id, ids, log_probs, event.finish_reason,
            top=top if log_probs is not None and top and len(top) == len(ids) else None,
            text=text_delta(self.decode, window, offset, final),
            prompt_tokens=len(self.prompt), completion_tokens=self.generated,
            cached_tokens=self.cached_tokens), self.cum_log_prob)
        out.update(self.prompt_logprobs)
        self.prompt_logprobs = {}
        return out

"""The orchestrator's calls to its engines (the context and generation models): what a
request's calls carry (:func:`engine_inputs`), how they travel (in-process BLS here,
tritonclient gRPC in :mod:`.grpc_transport`), their answers read back (the context's as the
request's first token event, :func:`context_event`; generation's, :func:`generation_answer`),
and token events turned into the ensemble's outputs (:class:`ResponseBuilder`; its
invariant: streamed ``text_output`` deltas concatenate to the non-streamed text,
multi-byte characters included, :func:`~triton_disagg.engine.tokenizer.text_delta`).

Transports: both implement :class:`triton_disagg.front.orchestrator.Transport`: ``route``
gives a request's :class:`~triton_disagg.front.orchestrator.Route`, whose calls move the tensors
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

This module holds what both transports share and the BLS transport (``serve all``); the
gRPC one (``serve scheduler``) is :mod:`.grpc_transport`.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence
# Any here: Triton's pb_utils module and its objects, which have no types.

import numpy as np

from triton_disagg import peers, protocol as P
from triton_disagg.engine.logprobs import TopLogprobs
from triton_disagg.engine.tokenizer import DeltaWindows, text_delta
from triton_disagg.errors import ErrorCode, Timeout, error_for, from_triton, without_tag
from triton_disagg.front.token_inbox import GenerationAnswer
from triton_disagg.token_wire import StreamEvent
from triton_disagg.triton.engine_request import top_logprob_outputs
from triton_disagg.protocol import scalar, to_batched

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
    (made on first use; idle ones cost nothing). Context calls take ``context_models`` (one
    per context instance: :func:`~triton_disagg.config.roles.instance_models`) in turn, as
    Triton spread them over one model's instances; a request's release goes to the model
    that holds its KV."""

    def __init__(self, pb_utils: Any, max_calls: int,
                 context_models: tuple[str, ...] = ("context",)):
        self.pb = pb_utils
        self.credential = peers.credential()
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

    async def context(self, inputs: dict) -> dict[str, np.ndarray]:
        self.context_model = self.transport.next_context_model()
        return await self._exec("context", inputs, call_parameters(self.credential, P.CONTEXT_ONLY),
                                self.timeout, queue_timeout=self.timeout, model=self.context_model)

    async def release(self, inputs: dict, handle: np.ndarray) -> None:
        await self._exec("context", release_inputs(inputs, handle),
                         call_parameters(self.credential, P.RELEASE_KV),
                         min(self.timeout, RELEASE_TIMEOUT_SECONDS), model=self.context_model)

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


# ---- what the calls carry, and their answers as the ensemble's outputs

def context_event(request_id: str, out: dict[str, np.ndarray]) -> StreamEvent:
    """The context model's response tensors as the request's first event (final when its
    ``finish_reason`` is set and not empty)."""
    ids = np.asarray(out["output_ids"]).reshape(-1).tolist()        # [beam=1, n] -> [n]
    lp = out.get("output_log_probs")
    log_probs = np.asarray(lp).reshape(-1).tolist() if lp is not None else None
    reason = out.get("finish_reason")
    reason = np.asarray(reason).reshape(-1)[0] if reason is not None and np.size(reason) else b""
    reason = reason.decode() if isinstance(reason, bytes) else str(reason)
    return StreamEvent(request_id, ids, log_probs, finish_reason=reason or None,
                       top=top_rows(out, len(ids)))


def top_rows(out: dict[str, np.ndarray], n: int) -> list[TopLogprobs] | None:
    """The ``TOP_LOGPROBS`` tensors of a response of ``n`` tokens, one row per token; None
    when absent (the request did not ask) or not of ``n`` rows; empty when they hold no
    alternatives (``k`` = 0)."""
    ids, lps = out.get("output_top_ids"), out.get("output_top_log_probs")
    if ids is None or lps is None or np.shape(ids) != np.shape(lps) or not np.ndim(ids):
        return None
    k = np.shape(ids)[-1]
    if k == 0:          # no alternatives: no rows (a reshape of 0 elements to [-1, 0] fails)
        return []
    ids, lps = np.reshape(ids, (-1, k)), np.reshape(lps, (-1, k))    # [.., n, k] -> [n, k]
    if len(ids) != n:
        return None
    return [TopLogprobs(i, v) for i, v in zip(ids.tolist(), lps.tolist())]


def engine_inputs(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Orchestrator inputs -> the ``ENGINE_INPUTS`` of context/generation (present ones only)."""
    names = {s.name for s in P.ENGINE_INPUTS}
    out = {n: v for n, v in inputs.items() if n in names}
    out.update({P.SAMPLING_TO_ENGINE[n]: v for n, v in inputs.items() if n in P.SAMPLING_TO_ENGINE})
    out["streaming"] = np.array([True])   # the orchestrator always streams from generation
    return out


class ResponseBuilder:
    """Turns a request's events into the ensemble's outputs (``text_output`` deltas, counts,
    the final response's ``finish_reason``, and log probs only when the request's
    ``return_log_probs`` asked for them, as
    TensorRT-LLM does: each tensor costs the stub a shared-memory copy per response; with
    them ``output_ids``, the ids of the tokens those log probs are of, and the
    ``TOP_LOGPROBS`` when the request's ``top_logprobs`` asked for alternatives)."""

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
        self.pending_ids: list[int] = []
        self.pending_lp: list[float] = []
        self.pending_top: list[TopLogprobs] = []

    def context_answered(self, out: dict[str, np.ndarray]) -> None:
        """Note how many prompt tokens the context served from its prefix cache, and the
        prompt's log-probs when it computed them (they go out with the first response)."""
        self.cached_tokens = int(scalar(out, P.NUM_CACHED_TOKENS, 0))
        self.prompt_logprobs = {s.name: out[s.name] for s in P.PROMPT_LOGPROBS if s.name in out}

    def add(self, event: StreamEvent) -> dict | None:
        """Outputs to send now (streaming) or None (accumulating until the final event, which
        carries no error: those are raised before they get here)."""
        ids = event.tokens
        lps = event.log_probs if event.log_probs is not None else [0.0] * len(ids)
        top = event.top or []
        if event.final and ids and ids[-1] == self.end_id:
            ids, lps, top = ids[:-1], lps[:-1], top[:-1]   # the end token is not output text
        self.generated += len(ids)
        self.cum_log_prob += float(sum(lps))
        self.pending_ids += ids
        self.pending_lp += lps
        self.pending_top += top
        if self.stream or event.final:
            return self._flush(event.finish_reason if event.final else None)
        return None

    def _flush(self, reason: str | None) -> dict:
        """The outputs of the tokens pending; ``reason``: the final response's (else None)."""
        final = reason is not None
        ids, lps, top = self.pending_ids, self.pending_lp, self.pending_top
        window, offset = self.windows.next(ids)
        self.pending_ids, self.pending_lp, self.pending_top = [], [], []
        out = {
            "text_output": [text_delta(self.decode, window, offset, final)],
            "num_input_tokens": np.array([len(self.prompt)], dtype=np.int32),
            "num_output_tokens": np.array([self.generated], dtype=np.int32),
            "num_cached_tokens": np.array([self.cached_tokens], dtype=np.int32),
        }
        if final:
            out["finish_reason"] = [reason]
        out.update(self.prompt_logprobs)
        self.prompt_logprobs = {}
        if self.return_log_probs:
            out["cum_log_probs"] = np.array([self.cum_log_prob])
            out["output_log_probs"] = np.array([lps], dtype=np.float32).reshape(1, -1)
            out["output_ids"] = np.array([ids], dtype=np.int32).reshape(1, -1)   # [beam=1, n]
            if top and len(top) == len(ids):
                out.update(top_logprob_outputs([t.ids for t in top], [t.logprobs for t in top]))
        return out

"""Triton tensors by the specs of :mod:`triton_disagg.protocol`: in and out of numpy dicts
in every model file, to and from token events, and to engine requests and from their results.

Tensors <-> token events (:func:`engine_event`, :func:`response_outputs`,
:func:`response_event`): the one place a token event
(:class:`~triton_disagg.engine.sequence.TokenEvent`) becomes Triton tensors or is read back
from them: the context's answer as the request's first event, the orchestrator's response
as its outputs, and those outputs back in the HTTP front.

Tensors <-> dicts (:func:`read_inputs`, :func:`make_tensors`, :func:`to_batched`,
:func:`scalar`): ``pb_utils`` (``triton_python_backend_utils``) only exists inside a Python
backend stub, so it is passed in, never imported; everything else here is plain numpy (and the HMACs
of the deployment secret, :mod:`triton_disagg.kv.secret`) and unit-tested without a server. Invariant: a dict handed to library code has one entry per
*present* input, with the batch axis removed (these models serve one sequence per request)
and the protocol dtype; a request whose batch is not 1 is refused, never sliced.

Tensors <-> engine requests, results -> tensors (:func:`from_inputs`, its inverse
:func:`engine_tensors`, :func:`outputs`, :func:`prefill_outputs`): ``ENGINE_INPUTS`` as an
:class:`~triton_disagg.engine.sequence.EngineRequest` (prompt + ``SamplingParams``), read by
the context and generation models (and any TensorRT-LLM-style client calling them
directly) and by the orchestrator's admission check; engine results as ``ENGINE_OUTPUTS``.
Invariant: :func:`from_inputs` either returns a request the engine can be given or raises
:class:`RequestError` with a message naming the input; every input is bounded by its shape
or value against the engine's limits before anything is built from it (a prompt of
``max_context`` tokens or more is refused before its ids are read, a word list by
:func:`~triton_disagg.engine.sampling.from_wire`), so a hostile request costs at most the
engine's limits.

Who may send them (:func:`check_peer`, :func:`check_seal`). Every request an orchestrator
sends to ``context`` or ``generation`` (BLS in ``serve all``, gRPC from a scheduler; release
calls included) carries the request parameter ``peer_credential`` (:func:`peer_credential`:
an HMAC of a fixed label under the deployment key of :mod:`triton_disagg.kv.secret`, which
only the deployment's servers hold); both models refuse a request without it before they
read its tensors, so a client that reaches Triton's endpoints (in ``serve all`` the public
repository holds ``context`` and ``generation`` too) gets neither a prefill, nor a
``context_phase_params`` handle, nor a decode stream. Servers of one deployment on several
hosts therefore share the secret (``TRITON_DISAGG_KV_SECRET``), in aggregated mode too. The
``orchestrator`` takes only what the ensemble's preprocessing or the HTTP front prepared
(both with :class:`~triton_disagg.front.tokenizer.Preprocessor`): the tensor
``preprocessed`` (:func:`seal`) is an HMAC, under a key derived from the secret
(:func:`seal_key`), of the tensors preprocessing produced (:data:`SEALED`), so a client that
calls the orchestrator directly cannot choose ``input_ids`` or the word lists, and one that
calls ``preprocessing`` itself gets a seal valid only for what preprocessing made of its
text, which it could have sent through the ensemble. Invariants: the credential and the seal
key are HMACs of fixed labels, so they reveal nothing of the key and differ from every other
value derived from it (handle tags, key ids, ZeroMQ keys); both checks compare in constant
time and their refusals name what is missing, never the expected value. The credential is a
bearer value: whoever reads it on the wire (gRPC between the roles is plaintext) can present
it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence
# Any here: Triton's pb_utils module and its objects, which have no types.

import numpy as np

from triton_disagg.engine.logprobs import TopLogprobs
from triton_disagg.engine.prompt_logprobs import PromptLogprobs
from triton_disagg.engine.sampling import MAX_CACHE_SALT, SamplingParams, from_wire, to_wire
from triton_disagg.engine.sequence import EngineRequest, TokenEvent
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.errors import ErrorCode, RequestError, UserError, triton_status
from triton_disagg.kv.secret import SECRET_ENV, deployment_key
from triton_disagg.protocol import (ENGINE_INPUTS, FINISH_REASONS, NUM_CACHED_TOKENS,
                                    PEER_CREDENTIAL, PREPROCESSED, PROMPT_LOGPROBS,
                                    TOP_LOGPROBS, TensorSpec)

if TYPE_CHECKING:       # the engine (its runners) is not imported where requests are read
    from triton_disagg.engine.llm_engine import PrefillResult


# ---- token events <-> response tensors ---------------------------------------------------

def engine_event(request_id: str, out: dict[str, np.ndarray]) -> TokenEvent:
    """An engine's response tensors (batch axis removed; the context's answer) as the
    request's first event (final when its ``finish_reason`` is set and not empty)."""
    ids = np.asarray(out["output_ids"]).reshape(-1).tolist()        # [beam=1, n] -> [n]
    lp = out.get("output_log_probs")
    log_probs = np.asarray(lp).reshape(-1).tolist() if lp is not None else None  # [1, n] -> [n]
    reason = out.get("finish_reason")
    reason = np.asarray(reason).reshape(-1)[0] if reason is not None and np.size(reason) else b""
    reason = reason.decode() if isinstance(reason, bytes) else str(reason)
    return TokenEvent(request_id, ids, log_probs, finish_reason=reason or None,
                      top=top_rows(out, len(ids)))


def response_outputs(event: TokenEvent, cum_log_prob: float) -> dict[str, Any]:
    """The orchestrator's response of ``event`` (a response: its text and counts set),
    :data:`ORCHESTRATOR_OUTPUTS` without the batch axis: ``finish_reason`` only when final,
    ``cum_log_probs`` (``cum_log_prob``: the request's so far), ``output_log_probs`` and
    ``output_ids`` only when it carries log-probs, the ``TOP_LOGPROBS`` only with ``top``."""
    out: dict[str, Any] = {
        "text_output": [event.text],
        "num_input_tokens": np.array([event.prompt_tokens], dtype=np.int32),
        "num_output_tokens": np.array([event.completion_tokens], dtype=np.int32),
        "num_cached_tokens": np.array([event.cached_tokens], dtype=np.int32),
    }
    if event.finish_reason is not None:
        out["finish_reason"] = [event.finish_reason]
    if event.log_probs is not None:
        out["cum_log_probs"] = np.array([cum_log_prob])
        out["output_log_probs"] = np.array([event.log_probs], dtype=np.float32).reshape(1, -1)
        out["output_ids"] = np.array([event.tokens], dtype=np.int32).reshape(1, -1)  # [beam=1, n]
        if event.top is not None:
            out.update(top_logprob_outputs([t.ids for t in event.top],
                                           [t.logprobs for t in event.top]))
    return out


def response_event(request_id: str, get: Callable[[str], np.ndarray | None]) -> TokenEvent:
    """An orchestrator response read back (``get(name)``: an output with its batch axis, or
    None; tritonclient's ``InferResult.as_numpy``); a finish reason this side does not know
    reads as none."""
    def one(name: str) -> Any:
        value = get(name)
        return None if value is None else value.reshape(-1)[0]       # [1, 1] -> scalar

    text, reason = one("text_output"), one("finish_reason")
    ids, lps = get("output_ids"), get("output_log_probs")
    tokens = ids.reshape(-1).tolist() if ids is not None else []      # [1, 1, n] -> [n]
    reason = reason.decode("utf-8") if reason is not None else None
    return TokenEvent(
        request_id, tokens, lps.reshape(-1).tolist() if lps is not None else None,  # -> [n]
        reason if reason in FINISH_REASONS else None,
        top=top_rows({s.name: get(s.name) for s in TOP_LOGPROBS}, len(tokens)),
        text=text.decode("utf-8") if text is not None else "",
        prompt_tokens=int(one("num_input_tokens") or 0),
        completion_tokens=int(one("num_output_tokens") or 0),
        cached_tokens=int(one("num_cached_tokens") or 0),
        prompt_logprobs=_prompt_logprobs(get))


def top_logprob_outputs(ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]]
                        ) -> dict[str, np.ndarray]:
    """The ``TOP_LOGPROBS`` tensors of ``n`` tokens' alternatives (``n`` rows of ``k``; beam
    axis of 1 included, batch axis added by the caller)."""
    k = len(ids[0]) if len(ids) else 0
    return {"output_top_ids": np.array(ids, dtype=np.int32).reshape(1, -1, k),          # [1, n, k]
            "output_top_log_probs": np.array(logprobs, dtype=np.float32).reshape(1, -1, k)}


def top_rows(out: dict[str, np.ndarray | None], n: int) -> list[TopLogprobs] | None:
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


def _prompt_logprobs(get: Callable[[str], np.ndarray | None]) -> PromptLogprobs | None:
    """The ``PROMPT_LOGPROBS`` tensors of a response, position 0's empty row dropped."""
    chosen, ids, top = (get(s.name) for s in PROMPT_LOGPROBS)
    if chosen is None or ids is None or top is None:
        return None
    k = ids.shape[-1]
    return PromptLogprobs(chosen.reshape(-1)[1:],                  # [1, n] -> [n-1]
                          ids.reshape(-1, k)[1:], top.reshape(-1, k)[1:])   # [1, n, k] -> [n-1, k]


# ---- tensors <-> dicts -------------------------------------------------------------------

def by_name(specs: Iterable[TensorSpec]) -> dict[str, TensorSpec]:
    return {s.name: s for s in specs}


def strip_batch(name: str, array: np.ndarray) -> np.ndarray:
    if array.ndim == 0 or array.shape[0] != 1:
        raise RequestError(f"input '{name}' has batch size {array.shape[0] if array.ndim else 0}; "
                           f"send one prompt per request (batch size 1)")
    return array[0]


def read_inputs(pb_utils: Any, request: Any, specs: Iterable[TensorSpec]) -> dict[str, np.ndarray]:
    """Every present input of ``request`` named in ``specs``, batch axis removed."""
    out = {}
    for spec in specs:
        tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
        if tensor is not None:
            out[spec.name] = strip_batch(spec.name, tensor.as_numpy())
    return out


def to_batched(specs: Iterable[TensorSpec], values: dict[str, Any]) -> dict[str, np.ndarray]:
    """Arrays with a leading batch axis of 1, in each spec's dtype, for every name in ``values``."""
    by = by_name(specs)
    out = {}
    for name, value in values.items():
        spec = by[name]
        if spec.dtype == "BYTES":
            arr = np.array([v.encode("utf-8") if isinstance(v, str) else v
                            for v in np.ravel(np.asarray(value, dtype=object))], dtype=np.object_)
            arr = arr.reshape(np.shape(value))
        else:
            arr = np.asarray(value, dtype=spec.numpy_dtype)
        out[name] = arr[np.newaxis, ...]
    return out


def make_tensors(pb_utils: Any, specs: Iterable[TensorSpec], values: dict[str, Any]) -> list:
    return [pb_utils.Tensor(name, arr) for name, arr in to_batched(specs, values).items()]


def scalar(inputs: dict[str, np.ndarray], name: str, default: Any = None) -> Any:
    """The single value of a ``[1]`` input, or ``default`` when absent."""
    if name not in inputs:
        return default
    arr = np.ravel(inputs[name])
    if arr.size != 1:
        raise RequestError(f"input '{name}' must hold one value, got {arr.size}")
    value = arr[0]
    return value.item() if hasattr(value, "item") else value


def asks(request: Any, parameter: str) -> bool:
    """Whether ``request`` (a ``pb_utils.InferenceRequest``) sets the request parameter
    ``parameter`` to true (Triton's per-request ``parameters``, which its stub gives as
    JSON)."""
    try:
        return json.loads(request.parameters() or "{}").get(parameter) is True
    except (AttributeError, TypeError, ValueError):
        return False


def error_response(pb_utils: Any, message: str, status: ErrorCode = ErrorCode.INTERNAL) -> Any:
    """A response carrying ``message`` with Triton status ``status`` (an error's
    :class:`~triton_disagg.errors.ErrorCode`, as :func:`~triton_disagg.errors.triton_status`
    writes it): INVALID_ARG reaches the client as HTTP 400 / gRPC INVALID_ARGUMENT,
    UNAVAILABLE and TIMEOUT as 503 / UNAVAILABLE, INTERNAL as 500."""
    name, text = triton_status(ErrorCode(status), message)
    error = pb_utils.TritonError(text, getattr(pb_utils.TritonError, name))
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


# ---- tensors <-> engine requests and results ------------------------------------------
# engine input -> SamplingParams field
_FIELDS = {"runtime_top_k": "top_k", "runtime_top_p": "top_p", "temperature": "temperature",
           "random_seed": "seed", "min_tokens": "min_tokens",
           "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "end_id": "end_id"}
_ENGINE_SPECS = by_name(ENGINE_INPUTS)
_DEFAULTS = SamplingParams()      # what an absent sampling input means


def from_inputs(inputs: dict[str, np.ndarray], spec: EngineSpec) -> EngineRequest:
    """The request in ``inputs`` (``ENGINE_INPUTS``, batch axis removed), bounded by
    ``spec``: a prompt under ``max_context`` tokens, ``request_output_len`` and
    ``min_tokens`` at most ``max_seq_len``, ``runtime_top_k`` at most the vocabulary."""
    prompt = np.asarray(inputs["input_ids"]).reshape(-1)        # [n] (any shape flattened)
    if prompt.size >= spec.max_context:
        raise RequestError(f"input_ids holds {prompt.size} tokens; this engine takes at most "
                           f"{spec.max_context - 1} (max_seq_len {spec.max_context} in all)")
    length = scalar(inputs, "input_lengths", len(prompt))
    if not 0 < length <= len(prompt):
        raise RequestError(f"input_lengths {length} does not fit input_ids of {len(prompt)} tokens")
    options = {field: scalar(inputs, name) for name, field in _FIELDS.items() if name in inputs}
    if options.get("end_id", 0) < 0:
        options["end_id"] = None     # TensorRT-LLM's "no end id"
    max_tokens = scalar(inputs, "request_output_len")
    for name, value, most in (("request_output_len", max_tokens, spec.max_seq_len),
                              ("min_tokens", options.get("min_tokens", 0), spec.max_seq_len),
                              ("runtime_top_k", options.get("top_k", 0), spec.shape.vocab_size)):
        if isinstance(value, (int, np.integer)) and value > most:
            raise RequestError(f"{name} {value} is over its bound {most} for this engine")
    options["cache_salt"] = cache_salt(inputs)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            stop_words=from_wire(inputs.get("stop_words_list"), "stop_words_list"),
            bad_words=from_wire(inputs.get("bad_words_list"), "bad_words_list"),
            return_log_probs=bool(scalar(inputs, "return_log_probs", False)),
            prompt_logprobs=scalar(inputs, "prompt_logprobs"),
            top_logprobs=scalar(inputs, "top_logprobs", 0), **options)
    except (UserError, ValueError) as exc:
        raise RequestError(str(exc)) from None
    return EngineRequest(prompt[:length].tolist(), params, bool(scalar(inputs, "streaming", False)))


def engine_tensors(request: EngineRequest) -> dict[str, np.ndarray]:
    """Inverse of :func:`from_inputs`: ``request`` as ``ENGINE_INPUTS`` (no batch axis), each
    sampling input only where its value is not the default an absent one means, so that
    ``from_inputs(engine_tensors(r), spec) == r`` for every ``r`` that :func:`from_inputs`
    returns. The one place an engine request becomes tensors (the orchestrator's calls)."""
    p = request.params
    values: dict[str, Any] = {"input_ids": request.prompt_ids,
                              "input_lengths": [len(request.prompt_ids)],
                              "request_output_len": [p.max_tokens],
                              "streaming": [request.streaming]}
    values.update({name: [getattr(p, field)] for name, field in _FIELDS.items()
                   if getattr(p, field) != getattr(_DEFAULTS, field)})
    if p.stop_words:
        values["stop_words_list"] = to_wire(p.stop_words)       # [2, N]
    if p.bad_words:
        values["bad_words_list"] = to_wire(p.bad_words)         # [2, N]
    if p.return_log_probs:
        values["return_log_probs"] = [True]
    if p.prompt_logprobs is not None:
        values["prompt_logprobs"] = [p.prompt_logprobs]
    if p.top_logprobs:
        values["top_logprobs"] = [p.top_logprobs]
    if p.cache_salt is not None:
        values["cache_salt"] = [p.cache_salt.encode("utf-8")]
    return {name: np.array(value, dtype=_ENGINE_SPECS[name].numpy_dtype)
            for name, value in values.items()}


def cache_salt(inputs: dict[str, np.ndarray]) -> str | None:
    """The request's ``cache_salt`` (UTF-8 BYTES ``[1]``), its size checked before it is
    decoded; None when absent."""
    raw = scalar(inputs, "cache_salt")
    if raw is None:
        return None
    raw = raw if isinstance(raw, bytes) else str(raw).encode("utf-8")
    if len(raw) > 4 * MAX_CACHE_SALT:
        raise RequestError(f"cache_salt has {len(raw)} bytes; at most {MAX_CACHE_SALT} "
                           f"characters")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError("cache_salt is not UTF-8 text") from None


def outputs(token_ids: Sequence[int], log_probs: Sequence[float | None], cum_log_prob: float,
            finish_reason: str | None, with_log_probs: bool = True,
            top: Sequence[TopLogprobs] = ()) -> dict[str, np.ndarray]:
    """One engine response (beam axis of 1 included; batch axis added by the caller).

    ``output_ids`` and ``sequence_length`` are always there; ``cum_log_probs`` and
    ``output_log_probs`` only ``with_log_probs`` (the request's ``return_log_probs``, as
    TensorRT-LLM does), the ``TOP_LOGPROBS`` only with ``top`` (one per token: the request's
    ``top_logprobs``); ``finish_reason`` only on a request's final response. Every tensor
    costs a shared-memory copy per streamed token, so nothing is sent that nobody asked for.
    """
    out = {"output_ids": np.array([list(token_ids)], dtype=np.int32),
           "sequence_length": np.array([len(token_ids)], dtype=np.int32)}
    if with_log_probs:
        lps = [0.0 if lp is None else lp for lp in log_probs]
        out["cum_log_probs"] = np.array([cum_log_prob], dtype=np.float32)
        out["output_log_probs"] = np.array([lps], dtype=np.float32).reshape(1, -1)
    if with_log_probs and top:
        out.update(top_logprob_outputs([t.ids for t in top], [t.logprobs for t in top]))
    if finish_reason is not None:
        out["finish_reason"] = np.array([finish_reason.encode()], dtype=np.object_)
    return out


def prefill_outputs(result: PrefillResult) -> dict[str, np.ndarray]:
    """A prefill's answer but its ``context_phase_params``: the first token with its
    log-prob (and alternatives, when asked), the prompt tokens served from the prefix cache,
    the prompt's log-probs when asked."""
    out = outputs([result.token_id], [result.logprob], result.logprob or 0.0,
                  result.finish_reason, top=[result.top] if result.top is not None else ())
    out[NUM_CACHED_TOKENS] = np.array([result.num_cached_tokens], dtype=np.int32)
    out.update(prompt_logprob_outputs(result.prompt_logprobs))
    return out


def prompt_logprob_outputs(logprobs: PromptLogprobs | None) -> dict[str, np.ndarray]:
    """A prefill's prompt log-probs as the ``PROMPT_LOGPROBS`` tensors (batch axis added by
    the caller): a row per prompt position, position 0's empty (NaN, ids -1); none when the
    request did not ask (``logprobs`` None)."""
    if logprobs is None:
        return {}
    k = logprobs.top_ids.shape[1]
    return {"prompt_log_probs": np.concatenate([[np.nan], logprobs.chosen]).astype(np.float32),
            "prompt_top_ids": np.concatenate([np.full((1, k), -1), logprobs.top_ids]
                                             ).astype(np.int32),                  # [n, k]
            "prompt_top_log_probs": np.concatenate([np.full((1, k), np.nan), logprobs.top]
                                                   ).astype(np.float32)}          # [n, k]


# ---- who may send them: the peer credential and the preprocessing seal --------------

_CREDENTIAL_LABEL = b"triton-disagg peer credential v1"
_SEAL_LABEL = b"triton-disagg preprocessed seal v1"
# What preprocessing produces and the orchestrator checks (its other inputs are the client's
# sampling options, which the orchestrator bounds itself).
SEALED = ("input_ids", "input_lengths", "request_output_len", "stop_words_list",
          "bad_words_list", "end_id", "pad_id")


def peer_credential() -> str:
    """This deployment's peer credential (what an orchestrator presents); reads the secret,
    so callers keep it for their lifetime."""
    return hmac.new(deployment_key(), _CREDENTIAL_LABEL, hashlib.sha256).hexdigest()


def check_peer(parameters: str | dict | None, model: str, expected: str) -> None:
    """Raise :class:`RequestError` unless a request's ``parameters`` (Triton's JSON string
    or a dict) carry ``expected`` (this deployment's :func:`peer_credential`)."""
    params = parameters if isinstance(parameters, dict) else json.loads(parameters or "{}")
    presented = params.get(PEER_CREDENTIAL) if isinstance(params, dict) else None
    if not isinstance(presented, str) or not hmac.compare_digest(   # a lone surrogate too
            presented.encode("utf-8", "surrogatepass"), expected.encode()):
        raise RequestError(f"the {model} model answers only this deployment's orchestrators "
                           f"(request parameter {PEER_CREDENTIAL!r} missing or wrong: clients call "
                           f"the ensemble; servers of one deployment share {SECRET_ENV})")


def seal_key() -> bytes:
    """The key of :func:`seal` (derived from the deployment secret; reads it)."""
    return hmac.new(deployment_key(), _SEAL_LABEL, hashlib.sha256).digest()


def seal(tensors: dict[str, np.ndarray], key: bytes) -> np.ndarray:
    """The seal of ``tensors`` (the :data:`SEALED` ones, batch axis removed): UINT8 [32]."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for name in SEALED:
        array = np.ascontiguousarray(tensors[name], dtype=np.int32)
        mac.update(f"{name}{list(array.shape)}".encode())
        mac.update(array.tobytes())
    return np.frombuffer(mac.digest(), dtype=np.uint8)


def check_seal(inputs: dict[str, np.ndarray], key: bytes) -> None:
    """Raise :class:`RequestError` unless ``inputs`` carry :data:`SEALED` and their seal."""
    presented = inputs.get(PREPROCESSED)
    missing = [name for name in SEALED if name not in inputs]
    if (presented is None or missing or np.size(presented) != 32
            or not hmac.compare_digest(np.asarray(presented, np.uint8).tobytes(),
                                       seal(inputs, key).tobytes())):
        raise RequestError(f"the orchestrator model takes only requests prepared by this "
                           f"deployment's preprocessing (tensor {PREPROCESSED!r} missing or "
                           f"not matching the request's tensors): clients call the ensemble "
                           f"or the HTTP front")

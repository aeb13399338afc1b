"""Triton tensors by the specs of :mod:`triton_disagg.protocol`: in and out of numpy dicts
in every model file, and to and from token events.

Tensors <-> token events (:func:`engine_event`, :func:`response_outputs`,
:func:`response_event`): the one place a token event
(:class:`~triton_disagg.engine.sequence.TokenEvent`) becomes Triton tensors or is read back
from them: the context's answer as the request's first event, the orchestrator's response
as its outputs, and those outputs back in the HTTP front.

Tensors <-> dicts (:func:`read_inputs`, :func:`make_tensors`, :func:`to_batched`,
:func:`scalar`): ``pb_utils`` (``triton_python_backend_utils``) only exists inside a Python
backend stub, so it is passed in, never imported; everything else here is plain numpy and
unit-tested without a server. Invariant: a dict handed to library code has one entry per
*present* input, with the batch axis removed (these models serve one sequence per request)
and the protocol dtype; a request whose batch is not 1 is refused, never sliced.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Sequence
# Any here: Triton's pb_utils module and its objects, which have no types.

import numpy as np

from triton_disagg.engine.logprobs import TopLogprobs
from triton_disagg.engine.prompt_logprobs import PromptLogprobs
from triton_disagg.engine.sequence import TokenEvent
from triton_disagg.errors import ErrorCode, RequestError, triton_status
from triton_disagg.protocol import FINISH_REASONS, PROMPT_LOGPROBS, TOP_LOGPROBS, TensorSpec


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

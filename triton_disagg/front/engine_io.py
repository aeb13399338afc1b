"""The orchestrator's tensors in and out: the engine inputs a request's calls to context
and generation carry, the context's answer as the request's first token event, and token
events as the ensemble's outputs (:class:`ResponseBuilder`).

Invariant (the builder's): streamed ``text_output`` deltas concatenate to the non-streamed
text, multi-byte characters included (:mod:`~triton_disagg.front.detokenize`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from triton_disagg import protocol as P
from triton_disagg.front.detokenize import DeltaWindows, text_delta
from triton_disagg.engine.logprobs import TopLogprobs
from triton_disagg.token_wire import StreamEvent
from triton_disagg.triton.engine_request import top_logprob_outputs
from triton_disagg.triton.tensors import scalar


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

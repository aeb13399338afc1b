"""Engine-side requests: protocol ``ENGINE_INPUTS`` -> prompt + :class:`SamplingParams`,
and engine results -> protocol ``ENGINE_OUTPUTS``.

Shared by the context and generation models (and any TensorRT-LLM-style
client calling them directly), and by the orchestrator's admission check. Invariant:
:func:`from_inputs` either returns a request the engine can be given or raises
:class:`RequestError` with a message naming the input; every input is bounded by its
shape or value against the engine's limits before anything is built from it (a prompt
of ``max_context`` tokens or more is refused before its ids are read, a word list by
:func:`~triton_disagg.engine.sampling.from_wire`), so a hostile request costs at most the
engine's limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from triton_disagg.engine.logprobs import TopLogprobs
from triton_disagg.engine.prompt_logprobs import PromptLogprobs
from triton_disagg.engine.sampling import MAX_CACHE_SALT, SamplingParams, from_wire
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.errors import RequestError, UserError
from triton_disagg.protocol import NUM_CACHED_TOKENS
from triton_disagg.triton.tensors import scalar, top_logprob_outputs

if TYPE_CHECKING:       # the engine (its runners) is not imported where requests are read
    from triton_disagg.engine.llm_engine import PrefillResult

# engine input -> SamplingParams field
_FIELDS = {"runtime_top_k": "top_k", "runtime_top_p": "top_p", "temperature": "temperature",
           "random_seed": "seed", "min_tokens": "min_tokens",
           "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "end_id": "end_id"}


@dataclass(frozen=True)
class EngineRequest:
    prompt_ids: list[int]
    params: SamplingParams
    streaming: bool


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

"""Engine-side requests: protocol ``ENGINE_INPUTS`` -> prompt + :class:`SamplingParams`,
and engine results -> protocol ``ENGINE_OUTPUTS``.

Shared by the context and generation models (and any TensorRT-LLM-style
client calling them directly). Invariant: :func:`from_inputs` either returns a
request the engine can be given or raises :class:`RequestError` with a message
naming the input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.errors import RequestError, UserError
from triton_disagg.front.preprocess import parse_word_list
from triton_disagg.triton.tensors import scalar

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


def from_inputs(inputs: dict[str, np.ndarray]) -> EngineRequest:
    prompt = np.asarray(inputs["input_ids"]).reshape(-1)
    length = scalar(inputs, "input_lengths", len(prompt))
    if not 0 < length <= len(prompt):
        raise RequestError(f"input_lengths {length} does not fit input_ids of {len(prompt)} tokens")
    options = {field: scalar(inputs, name) for name, field in _FIELDS.items() if name in inputs}
    if options.get("end_id", 0) < 0:
        options["end_id"] = None     # TensorRT-LLM's "no end id"
    try:
        params = SamplingParams(
            max_tokens=int(scalar(inputs, "request_output_len")),
            stop_words=parse_word_list(inputs.get("stop_words_list")),
            bad_words=parse_word_list(inputs.get("bad_words_list")),
            return_log_probs=bool(scalar(inputs, "return_log_probs", False)), **options)
    except UserError as exc:
        raise RequestError(str(exc)) from None
    return EngineRequest(prompt[:length].tolist(), params, bool(scalar(inputs, "streaming", False)))


def outputs(token_ids: Sequence[int], log_probs: Sequence[float | None], cum_log_prob: float,
            finish_reason: str | None, with_log_probs: bool = True) -> dict[str, np.ndarray]:
    """One engine response (beam axis of 1 included; batch axis added by the caller).

    ``output_ids`` and ``sequence_length`` are always there; ``cum_log_probs`` and
    ``output_log_probs`` only ``with_log_probs`` (the request's ``return_log_probs``, as
    TensorRT-LLM does); ``finish_reason`` only on a request's final response. Every tensor
    costs a shared-memory copy per streamed token, so nothing is sent that nobody asked for.
    """
    out = {"output_ids": np.array([list(token_ids)], dtype=np.int32),
           "sequence_length": np.array([len(token_ids)], dtype=np.int32)}
    if with_log_probs:
        lps = [0.0 if lp is None else lp for lp in log_probs]
        out["cum_log_probs"] = np.array([cum_log_prob], dtype=np.float32)
        out["output_log_probs"] = np.array([lps], dtype=np.float32).reshape(1, -1)
    if finish_reason is not None:
        out["finish_reason"] = np.array([finish_reason.encode()], dtype=np.object_)
    return out

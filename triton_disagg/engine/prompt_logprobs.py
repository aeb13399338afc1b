"""The log-probabilities of a prompt's own tokens (OpenAI's ``echo`` with ``logprobs``, vLLM's
``prompt_logprobs``; lm-eval's loglikelihood tasks read them).

For each prompt position ``i > 0``: ``log_softmax(logits[i - 1])[prompt[i]]``, the log-prob of
token ``i`` given tokens ``< i`` under the raw model (:mod:`.logprobs`; no sampling options
apply to the prompt, as in vLLM), and the ``top`` most likely tokens there with their
log-probs (most likely first).
Position 0 has none (nothing precedes it).

Cost: a prompt of ``n`` tokens is read ``CHUNK_ELEMENTS // V`` rows at a time (V =
vocabulary size): the runner makes that chunk's logits from the prompt's hidden states
(:class:`~triton_disagg.engine.model.LogitRows`) and the chunk is dropped once its
log-probs are taken, so the extra memory is about ``40 * CHUNK_ELEMENTS`` bytes (float32
logits, float64 log-probs and their temporaries) whatever ``n`` is; no ``[n, V]`` array
exists. The result is ``(n - 1) * (1 + top)`` numbers, ``top <= MAX_LOGPROBS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from triton_disagg.engine.logprobs import log_softmax, top_tokens
from triton_disagg.engine.model import LogitRows

CHUNK_ELEMENTS = 1 << 21     # logits per chunk (rows * V): 8 MiB float32, ~80 MiB at peak


@dataclass(frozen=True)
class PromptLogprobs:
    """``chosen [n-1]``: the log-prob of prompt tokens ``1..n-1``; ``top_ids``/``top`` ``[n-1,
    k]``: the ``k`` most likely tokens at each of those positions and their log-probs,
    most likely first."""

    chosen: np.ndarray
    top_ids: np.ndarray
    top: np.ndarray


def prompt_logprobs(logits: LogitRows, prompt_ids: Sequence[int], k: int) -> PromptLogprobs:
    """From the logits ``[n, V]`` of every position of a prompt of ``n`` tokens, read a chunk
    of rows at a time (each row independently). ``logits`` has a row per prompt token."""
    if logits.num_rows != len(prompt_ids):
        raise ValueError(f"{logits.num_rows} rows of logits for a prompt of {len(prompt_ids)} "
                         f"tokens")
    n = logits.num_rows - 1                           # rows 0..n-1 predict tokens 1..n
    targets = np.asarray(prompt_ids[1:], dtype=np.int64)                 # [n]
    width = min(k, logits.vocab_size)
    chosen = np.empty(n, np.float32)
    top_ids = np.empty((n, width), np.int32)
    top = np.empty((n, width), np.float32)
    step = max(1, CHUNK_ELEMENTS // logits.vocab_size)
    for start in range(0, n, step):
        stop = min(start + step, n)
        x = log_softmax(logits.rows(start, stop))                        # [stop-start, V]
        chosen[start:stop] = x[np.arange(stop - start), targets[start:stop]]
        top_ids[start:stop], top[start:stop] = top_tokens(x, k)          # [stop-start, k] each
    return PromptLogprobs(chosen, top_ids, top)

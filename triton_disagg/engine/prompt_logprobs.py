"""The log-probabilities of a prompt's own tokens (OpenAI's ``echo`` with ``logprobs``, vLLM's
``prompt_logprobs``; lm-eval's loglikelihood tasks read them).

For each prompt position ``i > 0``: ``log_softmax(logits[i - 1])[prompt[i]]``, the log-prob of
token ``i`` given tokens ``< i`` under the raw model (:mod:`.logprobs`; no sampling options
apply to the prompt, as in vLLM), and the ``top`` most likely tokens there with their
log-probs (most likely first).
Position 0 has none (nothing precedes it).

Cost: the prefill keeps the logits of every position of such a request, ``n * V * 4`` bytes
for a prompt of ``n`` tokens (V = vocabulary size); the result is ``(n - 1) * (1 + top)``
numbers, ``top <= MAX_LOGPROBS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from triton_disagg.engine.logprobs import log_softmax, top_tokens


@dataclass(frozen=True)
class PromptLogprobs:
    """``chosen [n-1]``: the log-prob of prompt tokens ``1..n-1``; ``top_ids``/``top`` ``[n-1,
    k]``: the ``k`` most likely tokens at each of those positions and their log-probs,
    most likely first."""

    chosen: np.ndarray
    top_ids: np.ndarray
    top: np.ndarray


def prompt_logprobs(logits: np.ndarray, prompt_ids: Sequence[int], k: int) -> PromptLogprobs:
    """From the logits ``[n, V]`` of every position of a prompt of ``n`` tokens."""
    x = log_softmax(logits[:-1])                                     # [n-1, V]: predicts 1..n-1
    chosen = x[np.arange(len(x)), np.asarray(prompt_ids[1:], dtype=np.int64)]    # [n-1]
    top_ids, top = top_tokens(x, k)                                  # [n-1, k] each
    return PromptLogprobs(chosen.astype(np.float32), top_ids, top)

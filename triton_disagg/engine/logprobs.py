"""Log-probabilities of tokens under the raw model: ``log_softmax`` of the logits the model
gave, before any sampling option (penalties, bad words, min_tokens, temperature, top-k/top-p)
touched them, as vLLM returns them by default (its ``logprobs_mode`` ``raw_logprobs``).
One copy of the math for a prompt's tokens (:mod:`.prompt_logprobs`) and the generated ones
(:mod:`.sampling`).

A token's ``top`` alternatives are the ``k`` most likely tokens at its position, most likely
first (ties: the lower id first), ``k <= MAX_LOGPROBS``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_LOGPROBS = 20     # alternatives per position (OpenAI: completions 5, chat 20)


@dataclass(frozen=True)
class TopLogprobs:
    """One generated token's ``k`` most likely alternatives and their log-probs, most likely
    first (plain ints and floats, ready for msgpack)."""

    ids: list[int]
    logprobs: list[float]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``log_softmax`` over the last axis of ``logits [..., V]``, in float64 (a new array)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def top_tokens(logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most likely tokens of each row of ``logprobs [rows, V]`` -> ``(ids [rows, k]
    int32, their log-probs [rows, k] float32)``, most likely first. O(rows * V)."""
    k = min(k, logprobs.shape[1])
    if not k:
        return np.zeros((len(logprobs), 0), np.int32), np.zeros((len(logprobs), 0), np.float32)
    ids = np.argpartition(-logprobs, k - 1, axis=1)[:, :k]             # [rows, k] unordered
    vals = np.take_along_axis(logprobs, ids, axis=1)
    order = np.lexsort((ids, -vals), axis=1)                           # likelier, then lower id
    return (np.take_along_axis(ids, order, axis=1).astype(np.int32),
            np.take_along_axis(vals, order, axis=1).astype(np.float32))


def top_of_row(logprobs: np.ndarray, k: int) -> TopLogprobs:
    """:func:`top_tokens` of one position's ``logprobs [V]``."""
    ids, vals = top_tokens(logprobs[None], k)                          # [V] -> [1, V]
    return TopLogprobs(ids[0].tolist(), vals[0].tolist())

"""Stop and bad word lists: their size caps, and per-token matching indexed by token.

Both are checked after every generated token, in Python, inside the decode step that
serves every co-batched sequence, so one request's lists must not slow the batch:

- Caps (per list): at most :data:`MAX_WORDS` words, :data:`MAX_WORD_TOKENS` tokens per
  word and :data:`MAX_LIST_TOKENS` tokens in all. OpenAI's API takes 4 stop sequences;
  vLLM and TensorRT-LLM set no count (TensorRT-LLM matches on the GPU). 64 words leave
  room for lists of variants ("\\n\\nUser:", "</s>", ...); 64 tokens is a sentence or
  two; 1024 in all bounds the tokens compared per step.
- Wire format (TensorRT-LLM's ``[2, N]`` INT32 word list: :func:`to_wire`,
  :func:`from_wire`): a client may send any ``[2, N]`` array, so :func:`from_wire` checks
  its shape, width and offsets against the caps before it builds a single word: its cost
  is bounded by the caps, never by ``N``.
- Matching looks only at words that can match at this step: a stop word whose last
  token is the newest token, a bad word whose second-to-last token is the newest token
  of the history. One-token bad words are banned at every step as one array.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

MAX_WORDS = 64
MAX_WORD_TOKENS = 64
MAX_LIST_TOKENS = 1024

Word = tuple[int, ...]


def count_error(name: str, count: int) -> str | None:
    """Why ``count`` words exceed :data:`MAX_WORDS`, naming ``name``; None when they fit."""
    if count > MAX_WORDS:
        return f"{name}: {count} words, at most {MAX_WORDS} are allowed; send fewer"
    return None


def word_length_error(name: str, index: int, length: int) -> str:
    """Why word ``index`` of ``name``, of ``length`` tokens, exceeds :data:`MAX_WORD_TOKENS`."""
    return (f"{name}[{index}]: {length} tokens, at most {MAX_WORD_TOKENS} per word are "
            f"allowed; send a shorter word")


def cap_error(name: str, words: Sequence[Sequence[int]]) -> str | None:
    """Why ``words`` (token-id lists) exceed the caps, as a one-line message naming
    ``name``; None when they fit."""
    too_many = count_error(name, len(words))
    if too_many:
        return too_many
    for i, word in enumerate(words):
        if len(word) > MAX_WORD_TOKENS:
            return word_length_error(name, i, len(word))
    total = sum(len(word) for word in words)
    if total > MAX_LIST_TOKENS:
        return (f"{name}: {total} tokens in all, at most {MAX_LIST_TOKENS} are allowed; "
                f"send fewer or shorter words")
    return None


def to_wire(words: Sequence[Sequence[int]]) -> np.ndarray:
    """TensorRT-LLM's ``[2, N]`` INT32 word list from each word's token ids: row 0 the ids
    of all words back to back, row 1 each word's end offset, padded with -1 (no words:
    ``[[0], [-1]]``)."""
    ids = [t for word in words for t in word]
    offsets = np.cumsum([len(word) for word in words], dtype=np.int64)
    out = np.full((2, max(1, len(ids))), -1, dtype=np.int32)    # [2, N]
    out[0, :] = 0
    out[0, :len(ids)] = ids
    out[1, :len(offsets)] = offsets
    return out


def from_wire(array: np.ndarray | None, name: str) -> tuple[Word, ...]:
    """Inverse of :func:`to_wire`: the words of a ``[2, N]`` list (empty words left out),
    or :class:`ValueError` naming ``name`` and what is wrong. Shape, width and offsets
    (the end offsets before the first negative one: strictly increasing, within the ids)
    are checked against the caps before any word is built, so a hostile ``N`` costs O(1);
    an accepted list costs O(:data:`MAX_LIST_TOKENS`)."""
    if array is None:
        return ()
    shape = np.shape(array)
    if len(shape) != 2 or shape[0] != 2:
        raise ValueError(f"{name}: shape {list(shape)}, expected [2, N] (ids, end offsets)")
    width = shape[1]
    if width > MAX_LIST_TOKENS:
        raise ValueError(f"{name}: {width} columns, at most {MAX_LIST_TOKENS} are allowed "
                         f"(the most tokens a list may hold); send fewer or shorter words")
    table = np.asarray(array)
    if table.dtype.kind not in "iu":
        raise ValueError(f"{name}: token ids and offsets must be integers, got {table.dtype}")
    table = table.astype(np.int64)                   # [2, N], N <= MAX_LIST_TOKENS
    offsets = table[1]
    ends = offsets[:int(np.argmax(offsets < 0))] if (offsets < 0).any() else offsets
    too_many = count_error(name, len(ends))
    if too_many:
        raise ValueError(too_many)
    starts = np.concatenate(([0], ends[:-1]))
    if len(ends) and (ends[-1] > width or (ends <= starts).any()):
        raise ValueError(f"{name}: end offsets {ends.tolist()} must increase strictly and "
                         f"stay within the {width} ids")
    words = tuple(tuple(table[0, start:end].tolist()) for start, end in zip(starts, ends))
    too_big = cap_error(name, words)
    if too_big:
        raise ValueError(too_big)
    return words


def _index(words: Sequence[Word], key: int) -> dict[int, tuple[Word, ...]]:
    """Words grouped by their token at position ``key`` (words too short are left out)."""
    out: dict[int, list[Word]] = {}
    for word in words:
        if len(word) >= -key:
            out.setdefault(word[key], []).append(word)
    return {token: tuple(group) for token, group in out.items()}


class StopWords:
    """Stop words, found when the generated tokens end with one (TensorRT-LLM semantics)."""

    def __init__(self, words: Sequence[Word]):
        self._by_last = _index(words, -1)

    def ends(self, output_ids: Sequence[int]) -> bool:
        """True when ``output_ids`` ends with one of the words."""
        if not len(output_ids):
            return False
        candidates = self._by_last.get(output_ids[-1], ())
        return any(len(output_ids) >= len(w) and tuple(output_ids[-len(w):]) == w
                   for w in candidates)


class BadWords:
    """Bad words: a one-token word is always banned; a longer word bans its last token when
    the history (prompt + generated) ends with the word's other tokens."""

    def __init__(self, words: Sequence[Word]):
        self.always = np.array(sorted({w[0] for w in words if len(w) == 1}), dtype=np.int64)
        self._by_prev = _index([w for w in words if len(w) > 1], -2)

    def banned_now(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> list[int]:
        """The last tokens of the longer words whose other tokens end the history."""
        history_end = output_ids[-1:] if len(output_ids) else prompt_ids[-1:]
        candidates = self._by_prev.get(history_end[0], ()) if len(history_end) else ()
        return [w[-1] for w in candidates if _history_ends_with(prompt_ids, output_ids, w[:-1])]


def _history_ends_with(prompt_ids: Sequence[int], output_ids: Sequence[int],
                       prefix: Word) -> bool:
    """``(prompt_ids + output_ids)`` ends with ``prefix``, without building the history."""
    n, n_out = len(prefix), len(output_ids)
    if n > len(prompt_ids) + n_out:
        return False
    if n <= n_out:
        return tuple(output_ids[n_out - n:]) == prefix
    head = n - n_out                                  # tokens that come from the prompt
    return (tuple(prompt_ids[len(prompt_ids) - head:]) == prefix[:head]
            and tuple(output_ids) == prefix[head:])

"""Per-request sampling options (with their stop and bad word lists) and the logits
processing that applies them.

:class:`Sampler` processes one sequence's logits in this order: bad words, min_tokens,
repetition penalty, presence/frequency penalties, temperature, top-k, top-p; then it
takes the argmax (temperature 0) or draws from the softmax.

- Bad words: a one-token word is always banned; a longer word bans its last token
  when the sequence (prompt + generated) ends with the word's other tokens. Stop and bad
  word lists are capped and matched through per-token indexes (below).
- Repetition penalty (Hugging Face semantics): over every distinct token of prompt +
  generated, positive logits are divided by it, negative ones multiplied.
- Presence / frequency penalties (OpenAI / TensorRT-LLM semantics): over generated
  tokens, ``logit -= presence * (count > 0) + frequency * count``.
- Draws are reproducible regardless of batch composition or of which instance draws:
  the draw for generated token ``i`` uses ``default_rng([seed, i])``.
- The reported log-probs are those of the raw model (:mod:`.logprobs`): ``log_softmax`` of
  the logits before penalties, bad words, min_tokens, temperature and top-k/top-p, as vLLM
  reports them by default; the chosen token's, and with ``top_logprobs`` k the k most likely
  tokens' (the chosen one may not be among them once options changed the distribution).
  They are computed only for requests with ``return_log_probs`` (a pass over the
  vocabulary; the top k one more): a request that does not ask pays nothing.
- Stop words (TensorRT-LLM semantics): a sequence finishes when its generated tokens end
  with a stop word; the stop word's tokens stay in the output.

Stop and bad word lists (:class:`StopWords`, :class:`BadWords`): both are checked after
every generated token, in Python, inside the decode step that serves every co-batched
sequence, so one request's lists must not slow the batch:

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

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from triton_disagg.engine.logprobs import MAX_LOGPROBS, TopLogprobs, log_softmax, top_of_row
from triton_disagg.errors import UserError


# ---- stop and bad word lists: caps, wire format, matching

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


# ---- the sampling options

MAX_CACHE_SALT = 256        # characters of a request's cache_salt


class SamplingParamsError(UserError):
    """A sampling option outside its valid range."""


def _word_list(name: str, words) -> tuple[tuple[int, ...], ...]:
    """``words`` as tuples of ids, each checked; the word count and each word's length are
    checked against the caps before the word is copied (a hostile list costs the caps)."""
    try:
        too_many = count_error(name, len(words))
        if too_many:
            raise SamplingParamsError(too_many)
        for i, word in enumerate(words):
            if len(word) > MAX_WORD_TOKENS:
                raise SamplingParamsError(word_length_error(name, i, len(word)))
        out = tuple(tuple(int(t) for t in word) for word in words)
    except (TypeError, ValueError):
        raise SamplingParamsError(
            f"{name} must be a list of token-id lists, got {words!r}") from None
    for word in out:
        if not word or min(word) < 0:
            raise SamplingParamsError(
                f"{name} entries must be non-empty lists of token ids >= 0, got {list(word)}")
    too_big = cap_error(name, out)
    if too_big:
        raise SamplingParamsError(too_big)
    return out


@dataclass(frozen=True)
class SamplingParams:
    """How to generate for one request. ``temperature == 0`` is greedy; ``top_k == 0`` and
    ``top_p == 1`` are off; penalties at 1.0 (repetition) and 0.0 (presence, frequency) are
    off; ``seed=None`` draws from fresh entropy; ``end_id=None`` never stops early."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    end_id: int | None = None
    stop_words: tuple[tuple[int, ...], ...] = field(default=())
    bad_words: tuple[tuple[int, ...], ...] = field(default=())
    return_log_probs: bool = False
    # None: off; k: the log-probs of the prompt's own tokens and the k most likely tokens at
    # each position (engine.prompt_logprobs); such a prompt never reads the prefix cache.
    prompt_logprobs: int | None = None
    # With return_log_probs: the k most likely tokens at each generated position, with their
    # log-probs (engine.logprobs), k in [0, MAX_LOGPROBS].
    top_logprobs: int = 0
    # Salts the names of the request's cached KV blocks (engine.block_pool): a prompt
    # reuses only the cache of requests with the same salt (None: the unsalted cache).
    cache_salt: str | None = None
    stop_index: StopWords = field(init=False, repr=False, compare=False)
    bad_index: BadWords = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise SamplingParamsError(message)

        def is_int(v) -> bool:
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        def is_real(v) -> bool:
            return isinstance(v, (int, float, np.number)) and not isinstance(v, bool) \
                and math.isfinite(v)

        check(is_int(self.max_tokens) and self.max_tokens >= 1,
              f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(is_real(self.temperature) and self.temperature >= 0,
              f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        check(is_int(self.top_k) and self.top_k >= 0,
              f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        check(is_real(self.top_p) and 0 < self.top_p <= 1,
              f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        check(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**64),
              f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        check(is_real(self.repetition_penalty) and self.repetition_penalty > 0,
              f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            check(is_real(getattr(self, name)),
                  f"{name} must be a finite number (0 = off), got {getattr(self, name)!r}")
        check(is_int(self.min_tokens) and self.min_tokens >= 0,
              f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        check(self.end_id is None or (is_int(self.end_id) and self.end_id >= 0),
              f"end_id must be a token id >= 0 or None, got {self.end_id!r}")
        check(isinstance(self.return_log_probs, (bool, np.bool_)),
              f"return_log_probs must be true or false, got {self.return_log_probs!r}")
        check(self.prompt_logprobs is None or (is_int(self.prompt_logprobs)
                                               and 0 <= self.prompt_logprobs
                                               <= MAX_LOGPROBS),
              f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
              f"got {self.prompt_logprobs!r}")
        check(is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_LOGPROBS,
              f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
              f"got {self.top_logprobs!r}")
        check(self.cache_salt is None or (isinstance(self.cache_salt, str)
                                          and len(self.cache_salt) <= MAX_CACHE_SALT),
              f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters or None, "
              f"got {str(self.cache_salt)[:40]!r}")
        object.__setattr__(self, "stop_words", _word_list("stop_words", self.stop_words))
        object.__setattr__(self, "bad_words", _word_list("bad_words", self.bad_words))
        object.__setattr__(self, "stop_index", StopWords(self.stop_words))
        object.__setattr__(self, "bad_index", BadWords(self.bad_words))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no logits processing at all: the token is the raw argmax. Lists every
        option :meth:`Sampler.process` acts on; a new logits option belongs in both."""
        return (self.greedy and not self.bad_words and self.min_tokens == 0
                and self.repetition_penalty == 1.0 and not self.presence_penalty
                and not self.frequency_penalty)

    def max_token_id(self) -> int:
        """The largest token id the options name (-1 if none), to check against the vocab."""
        ids = [t for word in self.stop_words + self.bad_words for t in word]
        return max(ids + ([self.end_id] if self.end_id is not None else []), default=-1)


class Sampler:
    """Turns one sequence's next-token logits into ``(token, logprob, top)``. Stateless."""

    def sample(self, logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int],
               output_ids: Sequence[int], seed: int
               ) -> tuple[int, float | None, TopLogprobs | None]:
        """``logits [V]`` for the token after ``prompt_ids + output_ids`` -> ``(token,
        logprob, top)``: the raw model's log-prob of the token, None unless
        ``params.return_log_probs``, and its ``params.top_logprobs`` most likely
        alternatives, None unless both asked; ``seed`` is the request's effective seed
        (``params.seed`` or one chosen when it was None)."""
        if params.plain_greedy:
            token = int(np.argmax(logits))           # nothing to process: skip the copy
        else:
            x = self.process(logits, params, prompt_ids, output_ids)
            if params.greedy:
                token = int(np.argmax(x))
            else:
                probs = np.exp(x - x.max())
                cdf = np.cumsum(probs)
                u = np.random.default_rng([seed, len(output_ids)]).random() * cdf[-1]
                token = min(int(np.searchsorted(cdf, u, side="right")), len(x) - 1)
        if not params.return_log_probs:
            return token, None, None
        raw = log_softmax(logits)                    # [V]
        top = top_of_row(raw, params.top_logprobs) if params.top_logprobs else None
        return token, float(raw[token]), top

    def process(self, logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int],
                output_ids: Sequence[int]) -> np.ndarray:
        """The processed float64 logits ``[V]`` (banned tokens at ``-inf``); a new array."""
        x = np.array(logits, dtype=np.float64)
        if params.bad_words:
            x[params.bad_index.always] = -np.inf
            x[params.bad_index.banned_now(prompt_ids, output_ids)] = -np.inf
        if params.end_id is not None and len(output_ids) < params.min_tokens:
            x[params.end_id] = -np.inf
        if params.repetition_penalty != 1.0 and len(prompt_ids) + len(output_ids):
            seen = np.unique(np.asarray(list(prompt_ids) + list(output_ids), dtype=np.int64))
            vals = x[seen]
            x[seen] = np.where(vals > 0, vals / params.repetition_penalty,
                               vals * params.repetition_penalty)
        if (params.presence_penalty or params.frequency_penalty) and output_ids:
            counts = Counter(output_ids)
            ids = np.fromiter(counts.keys(), dtype=np.int64)
            n = np.fromiter(counts.values(), dtype=np.float64)
            x[ids] -= params.presence_penalty + params.frequency_penalty * n
        if params.greedy:
            return x
        x /= params.temperature
        if 0 < params.top_k < len(x):
            kth = np.partition(x, -params.top_k)[-params.top_k]
            x[x < kth] = -np.inf
        if params.top_p < 1.0:
            order = np.argsort(-x, kind="stable")
            probs = np.exp(x[order] - x[order[0]])
            probs /= probs.sum()
            before = np.cumsum(probs) - probs          # mass of strictly more likely tokens
            x[order[before >= params.top_p]] = -np.inf
        return x

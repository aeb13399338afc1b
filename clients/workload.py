"""Synthetic workloads: prompt and output lengths drawn from distributions, and prompts
of a given token length.

A length distribution is written ``KIND:ARGS`` (also accepted from environment
variables by the locustfile):

- ``64`` or ``fixed:64``;
- ``uniform:32,128`` (both ends included);
- ``normal:64,16`` (mean, standard deviation);
- ``lognormal:64,0.5`` (median, sigma of the underlying normal: a long tail).

Invariant: :meth:`Lengths.sample` returns an int in ``[1, max]`` (``max``
defaults to 4096), whatever the parameters. Prompts are runs of words from the
demo tokenizer's training corpus; given a tokenizer, :func:`make_prompt` trims
them to at most the requested token count (re-tokenizing at the cut may come
out a token or two short), otherwise one word counts as one token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from triton_disagg.errors import UserError

KINDS = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2}


@dataclass(frozen=True)
class Lengths:
    kind: str
    params: tuple[float, ...]
    max: int = 4096

    @classmethod
    def parse(cls, text: str, name: str = "length", max: int = 4096) -> "Lengths":
        kind, _, args = str(text).strip().partition(":")
        if not args:
            kind, args = "fixed", kind
        try:
            params = tuple(float(a) for a in args.split(","))
        except ValueError:
            params = ()
        if kind not in KINDS or len(params) != KINDS[kind] or min(params) < 0:
            raise UserError(f"{name}: {text!r} is not a length distribution; write 64, "
                            f"uniform:32,128, normal:64,16 or lognormal:64,0.5")
        return cls(kind, params, max)

    def sample(self, rng: random.Random) -> int:
        p = self.params
        if self.kind == "fixed":
            value = p[0]
        elif self.kind == "uniform":
            value = rng.randint(int(min(p)), int(max(p)))
        elif self.kind == "normal":
            value = rng.gauss(p[0], p[1])
        else:
            value = rng.lognormvariate(0.0, p[1]) * p[0]
        return int(min(self.max, max(1, round(value))))


@lru_cache(maxsize=1)
def corpus_words() -> tuple[str, ...]:
    from importlib.resources import files

    return tuple(files("triton_disagg.builders").joinpath("demo_corpus.txt").read_text().split())


def make_prompt(n_tokens: int, rng: random.Random, tokenizer: Any = None) -> str:
    """About ``n_tokens`` tokens of corpus text starting at a random word; with a
    tokenizer (``encode``/``decode``), at most ``n_tokens`` of its tokens, except that a
    prompt cut down to one token may re-tokenize longer (it is never empty)."""
    words = corpus_words()
    start = rng.randrange(len(words))
    picked = [words[(start + i) % len(words)] for i in range(n_tokens)]
    text = " ".join(picked)
    if tokenizer is None:
        return text
    ids = tokenizer.encode(text)[:n_tokens]
    while True:   # the decoded cut may re-tokenize longer: drop tokens until it fits
        text = tokenizer.decode(ids)
        if len(ids) <= 1 or len(tokenizer.encode(text)) <= n_tokens:
            return text
        ids = ids[:-1]

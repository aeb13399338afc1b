"""The request streams of ``bench prefix`` (issue 29), as token ids, and what one infinite
prefix cache would save on each.

- ``shared``: ``groups`` x ``per_group`` prompts; the prompts of a group share a
  ``prefix_len``-token prefix and each ends in its own ``suffix_len`` tokens; sent
  interleaved in a seeded random order, so a cache must keep every group's prefix at once
  (a fixed rotation would be a round robin's luck: with 8 groups and 2 servers, group g
  would always land on server g mod 2).
- ``chat``: ``conversations`` x ``turns``; each turn's prompt is the whole conversation so
  far (the previous prompt, ``answer_len`` tokens standing for the answer, then the new
  message of ``message_len`` tokens); the turns go out in waves (every conversation's
  first turn, then every second turn once the first wave has answered), each wave in a
  seeded random order (for the same reason).
- ``unique``: prompts that share nothing, as long as ``shared``'s (the control).

Token ids are drawn from ``[first_id, vocab_size)`` so that no special token (BOS, EOS,
pad: the low ids of the demo tokenizer) appears. Every stream is a function of its seed:
two runs of a mode see the same tokens, and runs with different seeds share no block
(a later run finds nothing of an earlier one in the cache).

Invariant: :func:`ideal_hit_tokens` counts, per request in send order, the tokens a single
cache that never evicts would hold for it: whole blocks of ``tokens_per_block`` whose
chained prefix an earlier request already had, never the prompt's last token (its logits
are always computed, as vLLM and our engine do).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

WORKLOADS = ("shared", "chat", "unique")


@dataclass(frozen=True)
class PrefixRequest:
    prompt: tuple[int, ...]
    max_tokens: int
    wave: int              # requests of wave k go out once every request of wave k-1 ended


@dataclass(frozen=True)
class Shape:
    groups: int = 8
    per_group: int = 6
    prefix_len: int = 1024
    suffix_len: int = 32
    conversations: int = 8
    turns: int = 5
    first_len: int = 256         # chat: the first turn's prompt
    answer_len: int = 32
    message_len: int = 160
    output_len: int = 32


def requests_for(workload: str, shape: Shape, vocab_size: int, seed: int,
                 first_id: int = 3) -> list[PrefixRequest]:
    """The requests of ``workload`` in send order (see the module docstring)."""
    rng = random.Random(f"{workload}:{seed}")

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(first_id, vocab_size) for _ in range(n))

    if workload == "shared":
        prefixes = [tokens(shape.prefix_len) for _ in range(shape.groups)]
        out = [PrefixRequest(prefixes[g] + tokens(shape.suffix_len), shape.output_len, 0)
               for _ in range(shape.per_group) for g in range(shape.groups)]
        rng.shuffle(out)
        return out
    if workload == "chat":
        so_far = [tokens(shape.first_len) for _ in range(shape.conversations)]
        out = []
        for turn in range(shape.turns):
            wave = []
            for c in range(shape.conversations):
                if turn:
                    so_far[c] += tokens(shape.answer_len) + tokens(shape.message_len)
                wave.append(PrefixRequest(so_far[c], shape.output_len, turn))
            rng.shuffle(wave)
            out += wave
        return out
    if workload == "unique":
        n = shape.groups * shape.per_group
        return [PrefixRequest(tokens(shape.prefix_len + shape.suffix_len), shape.output_len, 0)
                for _ in range(n)]
    raise ValueError(f"workload {workload!r} is not one of {', '.join(WORKLOADS)}")


def ideal_hit_tokens(requests: Sequence[PrefixRequest], tokens_per_block: int) -> list[int]:
    """Per request, the prompt tokens one never-evicting cache would serve (module
    docstring)."""
    seen: set[tuple[int, ...]] = set()
    hits = []
    for request in requests:
        prompt, bs = request.prompt, tokens_per_block
        cacheable = (len(prompt) - 1) // bs          # whole blocks before the last token
        hit = 0
        while hit < cacheable and prompt[:(hit + 1) * bs] in seen:
            hit += 1
        hits.append(hit * bs)
        seen.update(prompt[:(k + 1) * bs] for k in range(len(prompt) // bs))
    return hits


def working_set_blocks(requests: Sequence[PrefixRequest], tokens_per_block: int) -> int:
    """Distinct whole blocks (by chained prefix) of every prompt: what a pool must hold to
    keep all of them cached."""
    return len({r.prompt[:(k + 1) * tokens_per_block] for r in requests
                for k in range(len(r.prompt) // tokens_per_block)})

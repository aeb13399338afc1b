"""The request streams of ``bench prefix`` (issue 29), as token ids, and what one infinite
prefix cache would save on each.

- ``shared``: ``groups`` x ``per_group`` prompts; the prompts of a group share a
  ``prefix_len``-token prefix and each ends in its own ``suffix_len`` tokens; sent
  interleaved in a seeded random order, so a cache must keep every group's prefix at once
  (a fixed rotation would be a round robin's luck: with 8 groups and 2 servers, group g
  would always land on server g mod 2).
- ``chat``: ``conversations`` x ``turns``, as a chat client sends them: every
  conversation's first prompt is one ``system_len``-token system prompt shared by all, then
  its first user message (``message_len`` tokens); each next turn's prompt is the whole
  conversation so far: the previous prompt, the token ids the server answered it (greedy,
  ``output_len`` of them), then the next message. So the turns go out in waves (every
  conversation's first turn; every second turn once the whole first wave has answered:
  :func:`wave` builds wave k from wave k-1's answers), each wave in a seeded random order
  (for the same reason).
- ``unique``: prompts that share nothing, as long as ``shared``'s (the control).

Token ids are drawn from ``[first_id, vocab_size)`` so that no special token (BOS, EOS,
pad: the low ids of the demo tokenizer) appears. Every stream is a function of its seed
and of the answers (chat's: greedy, so the same in every mode of one model): two runs of a
mode see the same tokens, and runs with different seeds share no block (a later run finds
nothing of an earlier one in the cache).

Invariant: :func:`ideal_hit_tokens` counts, per request in send order, the tokens a single
cache that never evicts would hold for it: whole blocks of ``tokens_per_block`` whose
chained prefix an earlier request already computed (its prompt, and its answer but the
last token, whose KV no step computes), never the prompt's last token (its logits are
always computed, as vLLM and our engine do).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

WORKLOADS = ("shared", "chat", "unique")
Answer = tuple[int, ...]            # the token ids the server generated for a request


@dataclass(frozen=True)
class PrefixRequest:
    prompt: tuple[int, ...]
    max_tokens: int
    wave: int              # requests of wave k go out once every request of wave k-1 ended
    conversation: int = -1  # chat: the conversation this turn is of


@dataclass(frozen=True)
class Shape:
    groups: int = 8
    per_group: int = 6
    prefix_len: int = 1024
    suffix_len: int = 32
    conversations: int = 8
    turns: int = 5
    # chat: the system prompt every conversation starts with. 1,024 tokens: a deployed
    # assistant's instructions and tool definitions run to a thousand tokens and more; it is
    # shared's prefix length; and the fifth turn (1,952 tokens, 32 more generated) still
    # fits the demo engine's 2,048.
    system_len: int = 1024
    message_len: int = 160       # chat: each user message, the first one too
    output_len: int = 32


def wave(workload: str, shape: Shape, vocab_size: int, seed: int, k: int,
         answered: Sequence[tuple[PrefixRequest, Answer]] = (),
         first_id: int = 3) -> list[PrefixRequest]:
    """Wave ``k`` of ``workload`` in send order, empty past the last (module docstring);
    ``answered``: wave ``k - 1``'s requests with their answers (chat's next prompts end
    with them; shared and unique are one wave)."""
    rng = random.Random(f"{workload}:{seed}")

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(first_id, vocab_size) for _ in range(n))

    if workload == "chat":
        system = tokens(shape.system_len)
        messages = [[tokens(shape.message_len) for _ in range(shape.turns)]
                    for _ in range(shape.conversations)]
        orders = [rng.sample(range(shape.conversations), shape.conversations)
                  for _ in range(shape.turns)]
        if k >= shape.turns:
            return []
        so_far = {c: system for c in range(shape.conversations)} if k == 0 else \
            {r.conversation: r.prompt + tuple(answer) for r, answer in answered}
        if sorted(so_far) != list(range(shape.conversations)) or \
                (k and len(answered) != shape.conversations):
            raise ValueError(f"chat wave {k}: wave {k - 1} answered conversations "
                             f"{sorted(r.conversation for r, _ in answered)}, not each of "
                             f"{shape.conversations} conversations once")
        return [PrefixRequest(so_far[c] + messages[c][k], shape.output_len, k, c)
                for c in orders[k]]
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r} is not one of {', '.join(WORKLOADS)}")
    if k:
        return []
    if workload == "shared":
        prefixes = [tokens(shape.prefix_len) for _ in range(shape.groups)]
        out = [PrefixRequest(prefixes[g] + tokens(shape.suffix_len), shape.output_len, 0)
               for _ in range(shape.per_group) for g in range(shape.groups)]
        rng.shuffle(out)
        return out
    n = shape.groups * shape.per_group
    return [PrefixRequest(tokens(shape.prefix_len + shape.suffix_len), shape.output_len, 0)
            for _ in range(n)]


def rehearsed(workload: str, shape: Shape, vocab_size: int, seed: int,
              answer: Callable[[PrefixRequest], Answer]) -> list[tuple[PrefixRequest, Answer]]:
    """Every wave of ``workload`` in send order, each request answered by ``answer`` (a
    stand-in for the server: to size the pools before a run, and in tests)."""
    out: list[tuple[PrefixRequest, Answer]] = []
    answered: list[tuple[PrefixRequest, Answer]] = []
    k = 0
    while requests := wave(workload, shape, vocab_size, seed, k, answered):
        answered = [(r, answer(r)) for r in requests]
        out += answered
        k += 1
    return out


def ideal_hit_tokens(answered: Sequence[tuple[PrefixRequest, Answer]],
                     tokens_per_block: int) -> list[int]:
    """Per request (in send order, with its answer), the prompt tokens one never-evicting
    cache would serve (module docstring)."""
    seen: set[tuple[int, ...]] = set()
    hits = []
    bs = tokens_per_block
    for request, answer in answered:
        prompt = request.prompt
        cacheable = (len(prompt) - 1) // bs          # whole blocks before the last token
        hit = 0
        while hit < cacheable and prompt[:(hit + 1) * bs] in seen:
            hit += 1
        hits.append(hit * bs)
        computed = prompt + tuple(answer)[:-1]       # the last answer token's KV: never
        seen.update(computed[:(k + 1) * bs] for k in range(len(computed) // bs))
    return hits


def working_set_blocks(requests: Sequence[PrefixRequest], tokens_per_block: int) -> int:
    """Distinct whole blocks (by chained prefix) of every prompt: what a pool must hold to
    keep all of them cached."""
    return len({r.prompt[:(k + 1) * tokens_per_block] for r in requests
                for k in range(len(r.prompt) // tokens_per_block)})

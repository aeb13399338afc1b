"""``bench prefix``'s request streams (issue 29, item 7): their sharing is what the issue
describes, and the ideal hit count is that of one cache that never evicts."""

from __future__ import annotations

import pytest

from triton_disagg.bench.prefix_cli import scaled
from triton_disagg.bench.prefix_workloads import (Shape, ideal_hit_tokens, requests_for,
                                                  working_set_blocks)

BS, VOCAB = 16, 2048


def _groups(requests, prefix_len):
    """The requests by their first ``prefix_len`` tokens, in send order."""
    groups: dict[tuple, list] = {}
    for r in requests:
        groups.setdefault(r.prompt[:prefix_len], []).append(r)
    return groups


def test_shared_prefix_groups_are_interleaved_and_share_exactly_their_prefix():
    shape = Shape()
    requests = requests_for("shared", shape, VOCAB, seed=0)
    assert len(requests) == 48 and {r.wave for r in requests} == {0}
    assert all(len(r.prompt) == 1024 + 32 and r.max_tokens == 32 for r in requests)
    groups = _groups(requests, 1024)
    assert sorted(len(g) for g in groups.values()) == [6] * 8
    assert len({r.prompt[1024:] for r in requests}) == 48           # suffixes all differ
    assert len({r.prompt[:16] for r in requests}) == 8              # no two groups share a block
    assert min(t for r in requests for t in r.prompt) >= 3      # no BOS/EOS/pad id
    first = {g[0].prompt for g in groups.values()}
    # interleaved in a random order: not group by group, nor a fixed rotation of the groups
    order = [list(groups).index(r.prompt[:1024]) for r in requests]
    assert order != sorted(order) and order[:8] != order[8:16]
    hits = ideal_hit_tokens(requests, BS)
    assert hits == [0 if r.prompt in first else 1024 for r in requests]


def test_a_chat_turn_extends_the_conversation_so_far_and_goes_out_in_waves():
    shape = Shape()
    requests = requests_for("chat", shape, VOCAB, seed=0)
    assert len(requests) == 40 and [r.wave for r in requests] == [t for t in range(5)
                                                                     for _ in range(8)]
    by_conversation = _groups(requests, 256)
    assert sorted(len(c) for c in by_conversation.values()) == [5] * 8
    for turns in by_conversation.values():
        assert [r.wave for r in turns] == list(range(5))
        for earlier, now in zip(turns, turns[1:]):
            assert now.prompt[:len(earlier.prompt)] == earlier.prompt
            assert len(now.prompt) == len(earlier.prompt) + 32 + 160
    waves = [[list(by_conversation).index(r.prompt[:256]) for r in requests[8 * t:8 * t + 8]]
             for t in range(5)]
    assert len({tuple(w) for w in waves}) > 1                   # each wave in its own order
    previous = {r.prompt[:256]: len(r.prompt) for r in requests[:0]}
    hits = ideal_hit_tokens(requests, BS)
    for r, hit in zip(requests, hits):
        key = r.prompt[:256]
        assert hit == (previous[key] // BS * BS if key in previous else 0)
        previous[key] = len(r.prompt)


def test_unique_prompts_share_no_block_and_seeds_share_nothing():
    unique = requests_for("unique", Shape(), VOCAB, seed=0)
    assert len(unique) == 48 and sum(ideal_hit_tokens(unique, BS)) == 0
    assert working_set_blocks(unique, BS) == 48 * 66
    again, other = (requests_for("shared", Shape(), VOCAB, seed=s) for s in (0, 1))
    assert again == requests_for("shared", Shape(), VOCAB, seed=0)
    assert sum(ideal_hit_tokens(again + other, BS)[48:]) == sum(ideal_hit_tokens(other, BS))


def test_the_last_token_is_never_a_hit():
    shape = Shape(groups=1, per_group=2, prefix_len=32, suffix_len=0)
    requests = requests_for("shared", shape, VOCAB, seed=0)
    assert requests[0].prompt == requests[1].prompt
    assert ideal_hit_tokens(requests, BS) == [0, 16]     # a whole-cached prompt: 1 block kept


def test_scale_shrinks_every_length_and_refuses_nonsense():
    small = scaled(Shape(), 0.25)
    assert (small.prefix_len, small.suffix_len, small.output_len) == (256, 8, 8)
    assert small.groups == 8
    with pytest.raises(Exception, match="--scale"):
        scaled(Shape(), 0)

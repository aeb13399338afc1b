"""``bench prefix``'s request streams (issue 29, item 7): their sharing is what the issue
describes, and the ideal hit count is that of one cache that never evicts."""

from __future__ import annotations

import pytest

from triton_disagg.bench.prefix_cli import scaled
from triton_disagg.bench.prefix_workloads import (Shape, ideal_hit_tokens, rehearsed, wave,
                                                  working_set_blocks)

BS, VOCAB = 16, 2048


def _model(request):
    """A stand-in for the server: greedy, so its answer is a function of the prompt."""
    return tuple(3 + (sum(request.prompt) * 31 + i) % (VOCAB - 3)
                 for i in range(request.max_tokens))


def _unanswered(requests):
    return [(r, ()) for r in requests]


def _groups(requests, prefix_len):
    """The requests by their first ``prefix_len`` tokens, in send order."""
    groups: dict[tuple, list] = {}
    for r in requests:
        groups.setdefault(r.prompt[:prefix_len], []).append(r)
    return groups


def test_shared_prefix_groups_are_interleaved_and_share_exactly_their_prefix():
    shape = Shape()
    requests = wave("shared", shape, VOCAB, 0, 0)
    assert wave("shared", shape, VOCAB, 0, 1, _unanswered(requests)) == []   # one wave
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
    hits = ideal_hit_tokens(_unanswered(requests), BS)
    assert hits == [0 if r.prompt in first else 1024 for r in requests]


def test_chat_turns_share_a_system_prompt_and_resend_the_servers_answers():
    """Every conversation opens with the one system prompt; turn k+1's prompt is turn k's,
    then exactly what the server answered it, then a new message; in waves."""
    answered = rehearsed("chat", Shape(), VOCAB, 1, _model)
    requests = [r for r, _ in answered]
    assert len(requests) == 40 and [r.wave for r in requests] == [t for t in range(5)
                                                                     for _ in range(8)]
    first_wave = requests[:8]
    assert len({r.prompt[:1024] for r in first_wave}) == 1              # the system prompt
    assert len({r.prompt[1024:1040] for r in first_wave}) == 8          # then its own message
    assert all(len(r.prompt) == 1024 + 160 for r in first_wave)
    turns: dict[int, list] = {}
    for r, answer in answered:
        turns.setdefault(r.conversation, []).append((r, answer))
    assert sorted(turns) == list(range(8))
    for conversation in turns.values():
        assert [r.wave for r, _ in conversation] == list(range(5))
        for (earlier, answer), (now, _) in zip(conversation, conversation[1:]):
            assert answer == _model(earlier) and len(answer) == 32
            assert now.prompt[:len(earlier.prompt) + 32] == earlier.prompt + answer
            assert len(now.prompt) == len(earlier.prompt) + 32 + 160
    orders = [[r.conversation for r in requests[8 * t:8 * t + 8]] for t in range(5)]
    assert len({tuple(o) for o in orders}) > 1                  # each wave in its own order


def test_chat_ideal_hits_count_the_system_prompt_and_the_answers_the_prompts_hold():
    answered = rehearsed("chat", Shape(), VOCAB, 1, _model)
    hits = ideal_hit_tokens(answered, BS)
    assert hits[0] == 0 and hits[1:8] == [1024] * 7        # the system prompt, once computed
    previous = {r.conversation: len(r.prompt) for r, _ in answered[:8]}
    for (r, _), hit in zip(answered[8:], hits[8:]):
        # the previous prompt and its answer but the last token: computed, so cached
        assert hit == (previous[r.conversation] + 32 - 1) // BS * BS
        previous[r.conversation] = len(r.prompt)
    # on the prompts sent: other answers make other prompts, and the ideal follows them
    other = rehearsed("chat", Shape(), VOCAB, 1, lambda r: _model(r)[::-1])
    assert [r.prompt for r, _ in other][8:] != [r.prompt for r, _ in answered][8:]
    assert ideal_hit_tokens([(r, a) for (r, _), (_, a) in zip(answered, other)], BS) != hits


def test_a_chat_wave_needs_every_conversation_answered_once():
    first = wave("chat", Shape(), VOCAB, 1, 0)
    with pytest.raises(ValueError, match="each of 8 conversations once"):
        wave("chat", Shape(), VOCAB, 1, 1, [(r, _model(r)) for r in first[:7]])
    assert wave("chat", Shape(), VOCAB, 1, 5, [(r, _model(r)) for r in first]) == []


def test_unique_prompts_share_no_block_and_seeds_share_nothing():
    unique = wave("unique", Shape(), VOCAB, 0, 0)
    assert len(unique) == 48 and sum(ideal_hit_tokens(_unanswered(unique), BS)) == 0
    assert working_set_blocks(unique, BS) == 48 * 66
    again, other = (wave("shared", Shape(), VOCAB, s, 0) for s in (0, 1))
    assert again == wave("shared", Shape(), VOCAB, 0, 0)
    assert sum(ideal_hit_tokens(_unanswered(again + other), BS)[48:]) == \
        sum(ideal_hit_tokens(_unanswered(other), BS))


def test_the_last_token_is_never_a_hit():
    shape = Shape(groups=1, per_group=2, prefix_len=32, suffix_len=0)
    requests = wave("shared", shape, VOCAB, 0, 0)
    assert requests[0].prompt == requests[1].prompt
    assert ideal_hit_tokens(_unanswered(requests), BS) == [0, 16]   # whole-cached: 1 block kept


def test_scale_shrinks_every_length_and_refuses_nonsense():
    small = scaled(Shape(), 0.25)
    assert (small.prefix_len, small.suffix_len, small.output_len) == (256, 8, 8)
    assert (small.system_len, small.message_len) == (256, 40)
    assert small.groups == 8 and small.conversations == 8
    assert len(rehearsed("chat", small, VOCAB, 1, _model)[-1][0].prompt) == 256 + 5 * 40 + 4 * 8
    with pytest.raises(Exception, match="--scale"):
        scaled(Shape(), 0)


def test_the_table_says_who_prefilled_and_when_a_mode_sent_other_prompts():
    """A mode whose answers differed sent other chat prompts: the table says so (never
    compares it silently); generation's own prefill shows apart, cache off unknown."""
    from triton_disagg.bench.prefix_cli import Run, markdown

    def run(mode, prefilled, by_generation, prompts):
        return Run(mode, "chat", "full", 400, prefilled, by_generation, 300, [0.1, 0.2], 1.0,
                   0, ["a", "b"], prompts)

    args = _args("--scale", "0.5")
    table = markdown([run("round_robin", 400, None, [(1, 2), (1, 2, 3)]),
                      run("kv_aware", 100, 60, [(1, 2), (1, 2, 3)]),
                      run("least_loaded+cache", 100, 60, [(1, 2), (1, 2, 4)])], args)
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in table.splitlines()
            if line.startswith("| ") and "---" not in line and "mode" not in line}
    assert rows["round_robin"][2] == "-" and rows["kv_aware"][1:4] == ["100", "60", "4.0"]
    assert rows["kv_aware"][-1] == "yes |" and rows["least_loaded+cache"][-1] == "NO |"
    # the prose says why the routers run without generation's local prefill, and the command
    assert "--local-prefill 256 --control-passes 5 --scale 0.5" in table
    assert "local prefill off" in table and "`kv_aware, local prefill 128`" in table


def _args(*argv: str):
    import argparse

    from triton_disagg.bench.prefix_cli import add_prefix_parser

    parser = argparse.ArgumentParser()
    add_prefix_parser(parser.add_subparsers())
    return parser.parse_args(["prefix", *argv])


def test_the_routers_are_compared_with_local_prefill_off_and_one_row_shows_it():
    """Every mode runs with generation's local prefill off (else generation prefills each
    repeat itself and no router decides), but one more kv_aware row per sharing workload,
    in full pools only, with it at --local-prefill (scaled as the workloads are)."""
    from triton_disagg.bench.prefix_cli import (MODES, local_prefill_tokens, planned,
                                                row_label)

    args = _args()
    modes = [MODES[n] for n in args.modes.split(",")]
    plan = planned(modes, args.workloads.split(","), half_pool=True)
    local = [(pool, mode.name, chosen) for pool, mode, chosen in plan
             if local_prefill_tokens(mode, args)]
    assert local == [("full", "kv_aware+local_prefill", ["shared", "chat"])]
    assert local_prefill_tokens(MODES["kv_aware+local_prefill"], args) == 256
    assert local_prefill_tokens(MODES["kv_aware+local_prefill"], _args("--scale", "0.25")) == 64
    assert [mode.name for pool, mode, _ in plan if pool == "full"] == list(MODES)
    assert [(mode.name, chosen) for pool, mode, chosen in plan if pool == "half"] == [
        (m, ["shared", "chat"]) for m in ("round_robin+cache", "least_loaded+cache", "kv_aware")]
    assert row_label(MODES["kv_aware+local_prefill"], 256) == "kv_aware, local prefill 256"
    assert row_label(MODES["kv_aware"], 0) == "kv_aware"
    # asked for unique alone, the local prefill row has nothing to run
    assert [m.name for _, m, _ in planned(modes, ["unique"], True)] == list(MODES)[:-1]


def test_the_control_shows_its_fastest_pass_and_checks_every_passs_texts():
    from triton_disagg.bench.prefix_cli import Run, best_pass

    def run(ttft, text):
        return Run("kv_aware", "unique", "full", 10, 10, 0, 0, ttft, 1.0, 0, [text], [(1,)])

    assert _args().control_passes == 5
    best = best_pass([run([0.3, 0.5], "a"), run([0.1, 0.2, 0.9], "b"), run([], "c")])
    assert best.ttft == [0.1, 0.2, 0.9] and best.texts == ["a", "b", "c"]
    assert best.prompts == [(1,)] * 3


@pytest.mark.parametrize("argv, flag", [(["--local-prefill", "0"], "--local-prefill"),
                                        (["--control-passes", "0"], "--control-passes")])
def test_nonsense_passes_or_local_prefill_are_refused_before_any_server(argv, flag):
    from triton_disagg.bench.prefix_cli import run

    with pytest.raises(Exception, match=flag):
        run(_args(*argv))


def test_the_warm_up_shares_no_block_with_any_run_of_any_workload():
    """The warm-up must not warm a cache: none of its blocks is a block a run sends."""
    from triton_disagg.bench.prefix_cli import (CONTROL_PASSES, WARM_UP, run_seed,
                                                warm_up_requests)
    from triton_disagg.bench.prefix_workloads import WORKLOADS

    shape = Shape()
    warm = warm_up_requests(shape, VOCAB)
    assert len(warm) == WARM_UP and len({r.prompt for r in warm}) == WARM_UP
    warm_blocks = {r.prompt[:BS * (i + 1)] for r in warm for i in range(len(r.prompt) // BS)}
    for workload in WORKLOADS:
        for k in range(CONTROL_PASSES):     # every pass any workload may send
            for request, _ in rehearsed(workload, shape, VOCAB, run_seed(workload, k), _model):
                assert request.prompt[:BS] not in warm_blocks

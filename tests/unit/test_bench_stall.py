"""bench stall's figures: per arrival the longest stream gap overlapping its handoff window
(first to second token), its median against the median of every stream gap."""

from __future__ import annotations

import pytest

from triton_disagg.bench.stall import server_figures, stall_figures
from triton_disagg.errors import UserError
from triton_disagg.routing.scrape import parse_metrics


def test_the_longest_gap_overlapping_each_window_against_the_median_gap():
    streams = [[0.0, 0.1, 0.2, 0.5, 0.6, 0.7],       # a 0.3 s gap from 0.2 to 0.5
               [0.05, 0.15, 0.25, 0.35, 0.45]]
    arrivals = [[0.3, 0.4],                          # overlaps 0.2-0.5 (0.3) and 0.25-0.35
                [0.62, 0.65],                        # overlaps 0.6-0.7 only (0.1)
                [0.66, 0.66],                        # one response of two tokens: in 0.6-0.7
                [0.9],                               # one token: no window
                []]                                  # failed
    stall = stall_figures("t", streams, arrivals, 1.0)
    assert stall.arrivals == 3 and stall.skipped == 2 and stall.stream_gaps == 9
    assert stall.window_max_gap_s == pytest.approx(0.1)       # median of 0.3, 0.1, 0.1
    assert stall.median_gap_s == pytest.approx(0.1)
    assert stall.ratio == pytest.approx(1.0)
    arrivals[2] = [0.3, 0.3]                                  # in 0.2-0.5 and 0.25-0.35
    assert stall_figures("t", streams, arrivals, 1.0).window_max_gap_s == pytest.approx(0.3)


def test_the_floor_is_the_same_figure_over_windows_between_arrivals():
    # one stream, a 10 ms gap everywhere but a 40 ms gap where the arrival's window lies
    times = [i * 0.01 for i in range(100)]
    stream = times[:50] + [t + 0.03 for t in times[50:]]     # the gap 0.49-0.53
    arrivals = [[0.50, 0.51],                               # the stall: 40 ms
                [0.70, 0.72]]                               # no stall: 10 ms gaps
    stall = stall_figures("t", [stream], arrivals, period=0.4)
    assert stall.window_max_gap_s == pytest.approx(0.025)   # median of 40 and 10 ms
    # windows +0.1, +0.2 and +0.3 s after each arrival's, all in 10 ms gaps but the first
    # arrival's +0.2 s one (0.70-0.71), which meets the second arrival's window: left out
    assert stall.floor_gap_s == pytest.approx(0.01)
    assert stall.floor == pytest.approx(1.0) and stall.ratio == pytest.approx(2.5)


def test_a_response_of_k_tokens_gives_k_token_times():
    from triton_disagg.clients.stream import Measurement

    m = Measurement(start=0.0)
    for at, count in ((1.0, 2), (1.5, 3), (2.0, 6)):   # num_output_tokens is cumulative
        m.on_response("x", 5, count, at)
    assert m.token_times == [1.0, 1.0, 1.5, 2.0, 2.0, 2.0]
    uncounted = Measurement(start=0.0)
    uncounted.on_response("x", None, None, 1.0)
    uncounted.on_response("x", None, None, 2.0)
    assert uncounted.token_times == [1.0, 2.0]


def test_no_window_over_a_stream_is_a_clear_error():
    with pytest.raises(UserError, match="no arrival's handoff window overlapped"):
        stall_figures("t", [[0.0, 0.1]], [[5.0, 5.1]], 1.0)
    with pytest.raises(UserError, match="no inter-token gaps"):
        stall_figures("t", [[0.0]], [[0.0, 0.1]], 1.0)


def test_the_server_figures_give_the_hidden_share_of_the_kv_in_flight():
    def samples(copies: float, in_flight: float, hidden: float, count: int, blocked: int):
        return parse_metrics(
            f'disagg_kv_transfer_seconds_sum{{role="generation"}} {copies}\n'
            f'disagg_kv_transfer_seconds_count{{role="generation"}} {count}\n'
            f'disagg_kv_fetch_seconds_sum{{role="generation"}} {in_flight}\n'
            f'disagg_kv_fetch_seconds_count{{role="generation"}} {count}\n'
            f'disagg_kv_fetch_hidden_seconds_sum{{role="generation"}} {hidden}\n'
            f'disagg_kv_fetch_hidden_seconds_count{{role="generation"}} {count}\n'
            f'disagg_decode_steps_blocked_by_transfer_total{{role="generation"}} {blocked}\n')

    before, after = samples(1.0, 2.0, 0.5, 10, 3), samples(1.1, 2.4, 0.8, 14, 3)
    assert server_figures(before, after) == \
        "copy 25.0 ms, in flight 100.0 ms (75% hidden), steps blocked 0"
    old_server = parse_metrics('disagg_kv_transfer_seconds_count{role="generation"} 1\n')
    assert "(n/a hidden)" in server_figures(old_server, old_server)

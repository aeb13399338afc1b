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
                [0.9],                               # one response: no window
                []]                                  # failed
    stall = stall_figures("t", streams, arrivals)
    assert stall.arrivals == 2 and stall.skipped == 2 and stall.stream_gaps == 9
    assert stall.window_max_gap_s == pytest.approx(0.2)       # median of 0.3 and 0.1
    assert stall.median_gap_s == pytest.approx(0.1)
    assert stall.ratio == pytest.approx(2.0)


def test_no_window_over_a_stream_is_a_clear_error():
    with pytest.raises(UserError, match="no arrival's handoff window overlapped"):
        stall_figures("t", [[0.0, 0.1]], [[5.0, 5.1]])
    with pytest.raises(UserError, match="no inter-token gaps"):
        stall_figures("t", [[0.0]], [[0.0, 0.1]])


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

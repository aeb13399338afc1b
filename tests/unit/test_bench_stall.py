"""bench stall's figures: per arrival the longest stream gap overlapping its handoff window
(first to second token), its median against the median of every stream gap."""

from __future__ import annotations

import pytest

from triton_disagg.bench.stall import stall_figures
from triton_disagg.errors import UserError


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

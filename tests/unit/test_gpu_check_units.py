"""The GPU check's arithmetic, on numbers: the weight-read limit of decode speed, and the
verdict on a low-precision greedy run against float32's (scripts/gpu_check*.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

from gpu_check_parity import (DIVERGENCE_MARGIN_TOLERANCE,  # noqa: E402
                              LOW_PRECISION_LOGIT_TOLERANCE, judge_low_precision)
from gpu_check_speed import weight_read_limit  # noqa: E402


def test_weight_read_limit_uses_the_copy_rate_whole():
    """A copy of 4 GB in 2 ms moves 8 GB (read + write): 4 TB/s, the memory's whole rate,
    which reading 16 GB of weights per step also gets: 250 steps/s, x batch tokens."""
    copy_rate = 2 * 4e9 / 2e-3                 # what copy_bandwidth returns
    assert weight_read_limit(1, copy_rate, 16 * 10**9) == 250.0
    assert weight_read_limit(64, copy_rate, 16 * 10**9) == 64 * 250.0


def logits_picking(tokens: list[int], vocab: int = 8, top: float = 5.0) -> np.ndarray:
    rows = np.zeros((len(tokens), vocab), np.float32)                 # [steps, V]
    rows[np.arange(len(tokens)), tokens] = top
    return rows


def test_equal_greedy_tokens_within_tolerance_pass():
    ref = logits_picking([1, 2, 3, 4])
    got = ref + LOW_PRECISION_LOGIT_TOLERANCE / 2
    verdict = judge_low_precision([1, 2, 3, 4], ref, [1, 2, 3, 4], got)
    assert verdict.ok and verdict.equal_steps == 4 and verdict.margin is None


def test_a_divergence_passes_only_as_a_near_tie():
    ref = logits_picking([1, 2, 3, 4])
    ref[2, 5] = 5.0 - DIVERGENCE_MARGIN_TOLERANCE / 2     # step 2: token 5 nearly ties 3
    near = judge_low_precision([1, 2, 3, 4], ref, [1, 2, 5, 0], ref.copy())
    assert near.equal_steps == 2 and near.ok
    assert abs(near.margin - DIVERGENCE_MARGIN_TOLERANCE / 2) < 1e-6
    ref[2, 5] = 1.0                                       # a clear winner flipped: FAIL
    far = judge_low_precision([1, 2, 3, 4], ref, [1, 2, 5, 0], ref.copy())
    assert far.equal_steps == 2 and not far.ok and far.margin == 4.0


def test_first_step_logits_beyond_tolerance_fail_even_with_equal_tokens():
    ref = logits_picking([1, 2])
    got = ref.copy()
    got[0, 7] += 2 * LOW_PRECISION_LOGIT_TOLERANCE
    verdict = judge_low_precision([1, 2], ref, [1, 2], got)
    assert verdict.equal_steps == 2 and not verdict.ok

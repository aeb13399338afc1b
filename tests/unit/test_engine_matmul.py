"""The engine's matmul picks a different BLAS call by row count; every path must agree."""

import numpy as np
import pytest

from triton_disagg.engine.model import SMALL_BATCH_ROWS, SMALL_BATCH_SLICE_BYTES, _matmul


@pytest.mark.parametrize("rows", [1, 2, 7, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 40])
def test_every_row_count_matches_a_plain_matmul(rows):
    rng = np.random.default_rng(rows)
    cols = 512
    # Enough output rows that the small-batch path needs several weight slices, plus a
    # ragged last slice.
    out_features = 3 * SMALL_BATCH_SLICE_BYTES // (cols * 4) + 5
    w = rng.standard_normal((out_features, cols), dtype=np.float32)   # [out, in]
    x = rng.standard_normal((rows, cols), dtype=np.float32)           # [T, in]
    got = _matmul(x, w)
    assert got.shape == (rows, out_features)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64),
                               rtol=1e-4, atol=1e-3)

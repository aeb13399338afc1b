"""engine.prompt_logprobs reads a prompt's logits a chunk of rows at a time: the same numbers
as all rows at once, and extra memory bounded by the chunk, not by the prompt's length (a
hostile ``echo`` + ``logprobs`` request of max_seq_len tokens must not cost ``n * V * 20``
bytes). numpy reports its allocations to tracemalloc, so its peak sees every array made."""

import tracemalloc

import numpy as np

from triton_disagg.engine import prompt_logprobs as pl
from triton_disagg.engine.logprobs import log_softmax, top_tokens
from triton_disagg.engine.model import LogitRows


def _rows_of(logits: np.ndarray) -> LogitRows:
    """A runner's on-demand rows over ``logits [n, V]`` (each call a new array, as a runner's
    matmul makes)."""
    return LogitRows(len(logits), logits.shape[1], lambda start, stop: logits[start:stop].copy())


def test_chunked_prompt_logprobs_equal_all_rows_at_once(monkeypatch):
    monkeypatch.setattr(pl, "CHUNK_ELEMENTS", 7 * 50)       # 7 rows of V=50 per chunk
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=4, size=(30, 50)).astype(np.float32)     # [n, V]
    prompt = rng.integers(0, 50, size=30).tolist()
    got = pl.prompt_logprobs(_rows_of(logits), prompt, 5)
    x = log_softmax(logits[:-1])                                       # [n-1, V]
    ids, top = top_tokens(x, 5)
    np.testing.assert_array_equal(got.chosen, x[np.arange(29), prompt[1:]].astype(np.float32))
    np.testing.assert_array_equal(got.top_ids, ids)
    np.testing.assert_array_equal(got.top, top)
    one = pl.prompt_logprobs(_rows_of(logits[:1]), prompt[:1], 5)      # nothing precedes 0
    assert one.chosen.shape == (0,) and one.top_ids.shape == (0, 5)


def test_peak_memory_is_bounded_by_the_chunk_not_the_prompt(monkeypatch):
    vocab, n = 4096, 4096
    chunk_rows = 16
    monkeypatch.setattr(pl, "CHUNK_ELEMENTS", chunk_rows * vocab)
    logits = np.random.default_rng(1).normal(size=(n, vocab)).astype(np.float32)  # 64 MiB
    prompt = list(range(n))
    tracemalloc.start()
    try:
        got = pl.prompt_logprobs(_rows_of(logits), prompt, 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got.top_ids.shape == (n - 1, 20)
    # ~40 bytes per chunk element (float32 rows, float64 log-probs and temporaries) plus the
    # result; all n rows at once would be ~20 bytes per element of [n, V]: 320 MiB here.
    result_bytes = (n - 1) * (1 + 2 * 20) * 4
    assert peak < 64 * chunk_rows * vocab + 2 * result_bytes, f"peak {peak / 2**20:.1f} MiB"

"""Block geometry and layout conversion between a sender's and a receiver's KV pool.

A pool is one C-contiguous array ``[num_blocks, L, 2, bs, kvh, hd]`` (K at index 0
of axis 2, V at 1; see ``triton_disagg.engine.spec.KVLayout``), so block ``i`` is the
byte range ``[i * block_nbytes, (i + 1) * block_nbytes)`` of the pool.

Context and generation may differ in ``tokens_per_block`` (bs) and KV dtype; the
receiver converts. Invariants:

- same bs and dtype: the copy is byte-exact (whole blocks, tail slots included);
- otherwise token ``t < num_tokens`` of every layer, K/V, head and channel equals the
  source value cast to the receiver's dtype (float32 -> float16 rounds to nearest
  even, float16 -> float32 is exact); slots at or past ``num_tokens`` are zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from triton_disagg.errors import UserError

KV_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class BlockGeometry:
    """The shape and dtype of one KV block: everything needed to read a block's bytes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str  # "float32" | "float16"

    def __post_init__(self) -> None:
        dims = (self.num_layers, self.num_kv_heads, self.head_dim, self.tokens_per_block)
        if not all(isinstance(d, int) and d > 0 for d in dims):
            raise ValueError(f"block dimensions must be positive integers, got {dims}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype must be one of {KV_DTYPES}, got {self.dtype!r}")

    @classmethod
    def of_pool(cls, pool: np.ndarray) -> "BlockGeometry":
        """The geometry of a pool array ``[num_blocks, L, 2, bs, kvh, hd]``."""
        if pool.ndim != 6 or pool.shape[2] != 2:
            raise UserError(
                f"KV pool must be [num_blocks, num_layers, 2, tokens_per_block, num_kv_heads, "
                f"head_dim], got shape {pool.shape}"
            )
        if pool.dtype.name not in KV_DTYPES or not pool.flags.c_contiguous:
            raise UserError(
                f"KV pool must be a C-contiguous float32 or float16 array, got "
                f"{pool.dtype.name} (contiguous={pool.flags.c_contiguous})"
            )
        _, layers, _, bs, kvh, hd = pool.shape
        return cls(int(layers), int(kvh), int(hd), int(bs), pool.dtype.name)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``(L, 2, bs, kvh, hd)``: one block, one row of the pool."""
        return (self.num_layers, 2, self.tokens_per_block, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        return int(np.prod(self.block_shape)) * np.dtype(self.dtype).itemsize

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.tokens_per_block)

    def same_model(self, other: "BlockGeometry") -> bool:
        """True when both describe the same model's KV (layers, heads, head size)."""
        return (self.num_layers, self.num_kv_heads, self.head_dim) == (
            other.num_layers, other.num_kv_heads, other.head_dim)


def convert_blocks(src: np.ndarray, num_tokens: int, dst_tokens_per_block: int,
                   dst_dtype: str) -> np.ndarray:
    """Re-block ``num_tokens`` tokens of ``src`` ``[n, L, 2, bs_src, kvh, hd]``.

    Returns a new ``[m, L, 2, bs_dst, kvh, hd]`` array in ``dst_dtype`` with
    ``m = ceil(num_tokens / bs_dst)``; slots past ``num_tokens`` are zero.
    """
    _, layers, two, _, kvh, hd = src.shape
    m = -(-num_tokens // dst_tokens_per_block)
    out = np.empty((m, layers, two, dst_tokens_per_block, kvh, hd), dtype=dst_dtype)
    _copy_tokens(src, num_tokens, out, range(m))
    return out


def write_blocks(src: np.ndarray, num_tokens: int, dst_pool: np.ndarray,
                 dst_block_ids: Sequence[int]) -> None:
    """Store ``num_tokens`` tokens of ``src`` ``[n, L, 2, bs_src, kvh, hd]`` into pool rows.

    ``dst_block_ids`` must name exactly ``ceil(num_tokens / bs_dst)`` blocks of
    ``dst_pool`` ``[num_blocks, L, 2, bs_dst, kvh, hd]``, in token order.
    """
    dst = BlockGeometry.of_pool(dst_pool)
    if len(dst_block_ids) != dst.blocks_for(num_tokens):
        raise ValueError(
            f"{num_tokens} tokens need {dst.blocks_for(num_tokens)} blocks of "
            f"{dst.tokens_per_block} tokens, got {len(dst_block_ids)} block ids")
    if src.ndim != 6 or (src.shape[1], src.shape[2], *src.shape[4:]) != (
            dst.num_layers, 2, dst.num_kv_heads, dst.head_dim):
        raise ValueError(f"source blocks {src.shape[1:]} do not match the pool's {dst.block_shape}")
    if src.shape[3] == dst.tokens_per_block and src.dtype == dst_pool.dtype:
        ids = np.asarray(dst_block_ids, dtype=np.int64)
        dst_pool[ids] = src[: len(ids)]                       # [m, L, 2, bs, kvh, hd], exact
    else:
        _copy_tokens(src, num_tokens, dst_pool, dst_block_ids)


def _copy_tokens(src: np.ndarray, num_tokens: int, dst: np.ndarray,
                 dst_ids: Sequence[int]) -> None:
    """One pass, casting on the fly: each run of tokens that shares a source block and a
    destination block is one slice copy, so at most ``n + m`` copies; the last
    destination block's slots past ``num_tokens`` are zeroed."""
    bs_src, bs_dst = src.shape[3], dst.shape[3]
    if src.shape[0] * bs_src < num_tokens:
        raise ValueError(f"{src.shape[0]} blocks of {bs_src} tokens cannot hold "
                         f"{num_tokens} tokens")
    t = 0
    while t < num_tokens:
        (i, a), (j, b) = divmod(t, bs_src), divmod(t, bs_dst)
        k = min(bs_src - a, bs_dst - b, num_tokens - t)
        dst[dst_ids[j], :, :, b:b + k] = src[i, :, :, a:a + k]   # [L, 2, k, kvh, hd], cast
        t += k
    if num_tokens % bs_dst:
        dst[dst_ids[-1], :, :, num_tokens % bs_dst:] = 0         # [L, 2, bs_dst - r, kvh, hd]


def runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src id, dst id, count)`` of each maximal run where both ids go up by one: one
    copy (or READ descriptor: UCX costs about 8 us each) per run instead of one per block."""
    s, d = np.asarray(src, np.int64), np.asarray(dst, np.int64)               # [n], [n]
    if len(s) == 0:
        return []
    starts = np.flatnonzero(np.r_[True, (np.diff(s) != 1) | (np.diff(d) != 1)])
    counts = np.diff(np.r_[starts, len(s)])
    return list(zip(s[starts].tolist(), d[starts].tolist(), counts.tolist()))

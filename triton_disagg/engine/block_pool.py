"""The paged KV cache of one model instance: a block pool and per-sequence block tables.

A :class:`BlockPool` owns ONE C-contiguous array ``[num_blocks, L, 2, bs, kvh, hd]``
(see :class:`triton_disagg.kv.layout.BlockGeometry`), so block ``i`` is one contiguous
byte range: a KV transfer registers the whole array once and moves whole blocks. A pool
whose KV a runner keeps in device memory has no array (``host_array=False``): it only
counts blocks, and handoffs pass through a bounded staging buffer
(:mod:`triton_disagg.kv.device_staging`).

Invariants: every block id in ``[0, num_total)`` is either free (reference count 0,
on the free list exactly once) or used (count >= 1, not on the free list);
``num_used + num_free == num_total``; a failed :meth:`BlockPool.allocate` changes
nothing. The pool knows nothing about models: it stores and copies bytes.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from triton_disagg.errors import UserError
from triton_disagg.kv.layout import BlockGeometry


class KVCacheFullError(Exception):
    """Not enough free blocks right now; the caller waits or rejects. Nothing was allocated."""


class BlockPool:
    """Fixed-size KV blocks with reference counts and a LIFO free list."""

    def __init__(self, geometry: BlockGeometry, num_blocks: int, host_array: bool = True):
        """``host_array`` False: the KV lives elsewhere (a runner's device memory) and
        :attr:`array` is None; the pool only counts blocks."""
        if num_blocks < 1:
            raise UserError(
                f"the KV cache needs at least 1 block ({geometry.block_nbytes} bytes); "
                f"raise kv_cache.max_size")
        self.geometry = geometry
        self.array = (np.zeros((num_blocks, *geometry.block_shape), dtype=geometry.dtype)
                      if host_array else None)
        self._refs = np.zeros(num_blocks, dtype=np.int64)
        # Popped from the end: low ids first, so a fresh pool hands out 0, 1, 2, ...
        self._free = list(range(num_blocks - 1, -1, -1))

    @staticmethod
    def blocks_for_budget(geometry: BlockGeometry, max_bytes: int) -> int:
        """How many whole blocks fit in ``max_bytes`` (``kv_cache.max_size``)."""
        return int(max_bytes) // geometry.block_nbytes

    @classmethod
    def from_budget(cls, geometry: BlockGeometry, max_bytes: int) -> "BlockPool":
        return cls(geometry, cls.blocks_for_budget(geometry, max_bytes))

    @property
    def num_total(self) -> int:
        return len(self._refs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_total - self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each), or raise :class:`KVCacheFullError`."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise KVCacheFullError(
                f"need {n} KV blocks, {len(self._free)} of {self.num_total} are free")
        ids = [self._free.pop() for _ in range(n)]
        self._refs[ids] = 1
        return ids

    def incref(self, blocks: Iterable[int]) -> None:
        """Add a reference to each (used) block, e.g. while a transfer reads it."""
        ids = self._check_used(blocks)
        np.add.at(self._refs, ids, 1)

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per listed block; a block at zero returns to the free list.

        Freeing a free block (double free) raises ``ValueError`` and changes nothing.
        """
        ids = self._check_used(blocks)
        drops = np.bincount(ids, minlength=self.num_total)
        if np.any(drops > self._refs):
            bad = int(np.flatnonzero(drops > self._refs)[0])
            raise ValueError(f"KV block {bad} freed more times than it is referenced")
        self._refs -= drops
        released = np.unique(ids[self._refs[ids] == 0])
        self._free.extend(int(i) for i in released[::-1])

    def refcount(self, block: int) -> int:
        return int(self._refs[block])

    def read_blocks(self, blocks: Sequence[int]) -> np.ndarray:
        """A copy of the listed blocks, ``[len(blocks), L, 2, bs, kvh, hd]``."""
        return self.array[self._check_used(blocks)]

    def write_blocks(self, blocks: Sequence[int], data: np.ndarray) -> None:
        """Overwrite the listed (used) blocks with ``data`` ``[len(blocks), L, 2, bs, kvh, hd]``."""
        ids = self._check_used(blocks)
        if data.shape != (len(ids), *self.geometry.block_shape):
            raise ValueError(f"{data.shape[0]} blocks of shape {data.shape[1:]} do not fit "
                             f"{len(ids)} pool blocks of shape {self.geometry.block_shape}")
        self.array[ids] = data

    def _check_used(self, blocks: Iterable[int]) -> np.ndarray:
        ids = np.fromiter((int(b) for b in blocks), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_total):
            raise ValueError(f"KV block ids must be in [0, {self.num_total}), got {ids.tolist()}")
        if np.any(self._refs[ids] == 0):
            bad = int(ids[self._refs[ids] == 0][0])
            raise ValueError(f"KV block {bad} is not allocated")
        return ids


class BlockTable:
    """The blocks holding one sequence's KV, in position order.

    Token ``t`` lives in block ``block_ids[t // bs]`` at slot ``t % bs``. Invariant:
    ``num_tokens <= len(block_ids) * bs`` (blocks may be reserved ahead of tokens).
    """

    def __init__(self, tokens_per_block: int, block_ids: Sequence[int] = (), num_tokens: int = 0):
        self.tokens_per_block = tokens_per_block
        self.block_ids = list(block_ids)
        self.num_tokens = 0
        self.advance(num_tokens)

    @property
    def capacity(self) -> int:
        return len(self.block_ids) * self.tokens_per_block

    def blocks_needed(self, num_new_tokens: int) -> int:
        """Extra blocks required before ``num_new_tokens`` more tokens fit."""
        total = self.num_tokens + num_new_tokens
        return max(0, -(-total // self.tokens_per_block) - len(self.block_ids))

    def reserve(self, pool: BlockPool, num_new_tokens: int) -> None:
        """Allocate the blocks ``num_new_tokens`` more tokens need; all or nothing."""
        self.block_ids += pool.allocate(self.blocks_needed(num_new_tokens))

    def advance(self, n: int) -> None:
        """Record that the KV of ``n`` more tokens has been (or is being) written."""
        if self.num_tokens + n > self.capacity:
            raise ValueError(f"{self.num_tokens + n} tokens do not fit in "
                             f"{len(self.block_ids)} blocks of {self.tokens_per_block}")
        self.num_tokens += n

    def release(self, pool: BlockPool) -> None:
        """Free every block and forget them."""
        pool.free(self.block_ids)
        self.block_ids, self.num_tokens = [], 0

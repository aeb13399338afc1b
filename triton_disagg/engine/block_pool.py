"""The paged KV cache of one model instance: a block pool and per-sequence block tables.

A :class:`BlockPool` owns ONE C-contiguous array ``[num_blocks, L, 2, bs, kvh, hd]``
(see :class:`triton_disagg.kv.layout.BlockGeometry`), so block ``i`` is one contiguous
byte range: a KV transfer registers the whole array once and moves whole blocks. A pool
whose KV a runner keeps in device memory has no array (``host_array=False``): it only
counts blocks, and handoffs pass through a bounded staging buffer
(:mod:`triton_disagg.kv.device_staging`).

With prefix caching (the default; ``kv_cache.prefix_caching``) full blocks whose KV is
written are named (:meth:`BlockPool.cache_blocks`, names from
:mod:`triton_disagg.engine.prefix_cache`) and shared by reference count: a new sequence takes
the blocks of its cached prefix (:meth:`BlockPool.take`) instead of computing them. A named
block no one holds is parked on the cache's LRU list (:mod:`triton_disagg.engine.prefix_cache`)
and counts as free: an allocation takes never-cached free blocks first and evicts parked
ones, oldest first, only when those run out, so the cache never makes an allocation fail
that would succeed without it.

Invariants: every block id in ``[0, num_total)`` is exactly one of: free (reference count
0, on the free list once), parked (count 0, named, on the LRU list once), or used (count
>= 1, held by a live sequence or handle, maybe named); ``num_used + num_free == num_total``
(``num_free`` counts parked blocks); a named block is full and never written again; a
failed :meth:`BlockPool.allocate` or :meth:`BlockPool.take` changes nothing. The pool knows
nothing about models: it stores and copies bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

import numpy as np

from triton_disagg.engine.prefix_cache import PrefixCache
from triton_disagg.errors import UserError
from triton_disagg.kv.layout import BlockGeometry


class BlockEvents(Protocol):
    """Hears what enters and leaves a pool's prefix cache (e.g. a KV events publisher in
    vLLM's format); called on the thread that owns the pool, so it must not block."""

    def stored(self, block_hashes: list[int], parent_hash: int | None, token_ids: list[int],
               block_size: int) -> None:
        """Full blocks entered the cache: ``block_hashes`` chain on from ``parent_hash``
        (None: the first block of a sequence); ``token_ids``: ``block_size`` per block."""

    def removed(self, block_hashes: list[int]) -> None:
        """Cached blocks were evicted (their KV now belongs to something else)."""

    def cleared(self) -> None:
        """Every cached block was forgotten."""


@dataclass(frozen=True)
class PoolStats:
    """One reading of a pool for its gauges and counters (``disagg_kv_blocks_*``,
    ``disagg_prefix_cache_*``); the last four are running totals since the pool began."""

    used: int                 # held by live requests (0 at rest)
    total: int
    cached: int               # holding a cached prefix, held or parked
    query_tokens: int         # prompt tokens looked up in the cache
    hit_tokens: int           # of which the cache held the KV
    evicted_blocks: int
    prefilled_tokens: int     # of the looked-up tokens not held, those computed here (not fetched)


class KVCacheFullError(Exception):
    """Not enough free blocks right now; the caller waits or rejects. Nothing was allocated."""


class BlockPool:
    """Fixed-size KV blocks with reference counts, a LIFO free list and a prefix cache."""

    def __init__(self, geometry: BlockGeometry, num_blocks: int, host_array: bool = True,
                 prefix_caching: bool = True, events: BlockEvents | None = None):
        """``host_array`` False: the KV lives elsewhere (a runner's device memory) and
        :attr:`array` is None; the pool only counts blocks. ``prefix_caching`` False: no
        block is ever named (:attr:`cache` is None); ``events`` hears the cache's changes."""
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
        self.cache = PrefixCache(geometry.tokens_per_block, events) if prefix_caching else None

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
        """Blocks an allocation may take: never-cached free ones and parked cached ones."""
        return len(self._free) + (self.cache.num_parked if self.cache is not None else 0)

    @property
    def num_used(self) -> int:
        """Blocks held by a live sequence or handle (0 at rest, whatever the cache holds)."""
        return self.num_total - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a named prefix (held or parked)."""
        return self.cache.num_cached if self.cache is not None else 0

    def stats(self) -> PoolStats:
        cache = self.cache
        return PoolStats(self.num_used, self.num_total, self.num_cached,
                         cache.query_tokens if cache else 0, cache.hit_tokens if cache else 0,
                         cache.evicted_blocks if cache else 0,
                         cache.prefilled_tokens if cache else 0)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each), or raise :class:`KVCacheFullError`.
        Never-cached blocks go first; then the least recently parked cached ones are evicted."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise KVCacheFullError(
                f"need {n} KV blocks, {self.num_free} of {self.num_total} are free")
        fresh = min(n, len(self._free))
        ids = [self._free.pop() for _ in range(fresh)]
        if n > fresh:
            ids += self.cache.evict(n - fresh)
        self._refs[ids] = 1
        return ids

    def match(self, block_hashes: Sequence[int]) -> list[int]:
        """The cached blocks of the longest leading run of ``block_hashes`` (no reference
        taken: :meth:`take` them before anything else allocates)."""
        return self.cache.match(block_hashes) if self.cache is not None else []

    def take(self, cached: Sequence[int], n_new: int) -> list[int]:
        """Hold the ``cached`` blocks :meth:`match` returned (one more reference each) and
        allocate ``n_new`` more; returns ``cached + new``. All or nothing: raises
        :class:`KVCacheFullError` when a parked block it takes back and the new ones
        together need more than :attr:`num_free`."""
        cached = [int(b) for b in cached]
        parked = sum(1 for b in cached if self._refs[b] == 0)
        if n_new < 0:
            raise ValueError(f"cannot allocate {n_new} blocks")
        if parked + n_new > self.num_free:
            raise KVCacheFullError(
                f"need {parked + n_new} KV blocks ({len(cached)} cached), {self.num_free} "
                f"of {self.num_total} are free")
        for b in cached:
            if self._refs[b] == 0:
                self.cache.unpark(b)
            self._refs[b] += 1
        return cached + self.allocate(n_new)

    def cache_blocks(self, blocks: Sequence[int], block_hashes: Sequence[int],
                     parent_hash: int | None, token_ids: Sequence[int]) -> None:
        """Name full, written, held ``blocks`` by ``block_hashes`` (chained on from
        ``parent_hash``; ``token_ids``: their tokens) so that later prompts reuse them; a
        no-op without prefix caching."""
        if self.cache is not None:
            self._check_used(blocks)
            self.cache.store(blocks, block_hashes, parent_hash, token_ids)

    def clear_cache(self) -> None:
        """Forget every cached prefix: parked blocks become plain free blocks; held ones
        return to the free list when released."""
        if self.cache is not None:
            self._free.extend(reversed(self.cache.clear()))

    def incref(self, blocks: Iterable[int]) -> None:
        """Add a reference to each (used) block, e.g. while a transfer reads it."""
        ids = self._check_used(blocks)
        np.add.at(self._refs, ids, 1)

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per listed block; a block at zero is parked if it is cached,
        else returns to the free list. Blocks are parked last-listed first, so a sequence's
        tail is evicted before its prefix (other prompts share prefixes, not tails).

        Freeing a free block (double free) raises ``ValueError`` and changes nothing.
        """
        ids = self._check_used(blocks)
        drops = np.bincount(ids, minlength=self.num_total)
        if np.any(drops > self._refs):
            bad = int(np.flatnonzero(drops > self._refs)[0])
            raise ValueError(f"KV block {bad} freed more times than it is referenced")
        self._refs -= drops
        released = dict.fromkeys(int(i) for i in ids[::-1] if self._refs[i] == 0)  # last first
        unnamed = [b for b in released if self.cache is None or not self.cache.park(b)]
        self._free.extend(sorted(unnamed, reverse=True))     # low ids are handed out first

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

    def reserve(self, pool: BlockPool, num_new_tokens: int,
                block_hashes: Sequence[int] = ()) -> int:
        """Allocate the blocks ``num_new_tokens`` more tokens need; all or nothing. On an
        empty table the cached blocks named by the leading ``block_hashes`` are taken
        instead of new ones and their tokens count as written (the caller names only blocks
        it need not compute); returns how many tokens of KV the cache provided."""
        needed = self.blocks_needed(num_new_tokens)
        cached = pool.match(block_hashes)[:needed] if not self.block_ids else []
        self.block_ids += pool.take(cached, needed - len(cached))
        self.advance(len(cached) * self.tokens_per_block)
        return len(cached) * self.tokens_per_block

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

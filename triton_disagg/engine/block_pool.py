"""The paged KV cache of one model instance: a block pool, per-sequence block tables, and
the prefix cache that names full blocks so that sequences share them.

The pool. A :class:`BlockPool` owns ONE C-contiguous array ``[num_blocks, L, 2, bs, kvh, hd]``
(see :class:`triton_disagg.kv.layout.BlockGeometry`), so block ``i`` is one contiguous
byte range: a KV transfer registers the whole array once and moves whole blocks. A pool
whose KV a runner keeps in device memory has no array (``host_array=False``): it only
counts blocks, and handoffs pass through a bounded staging buffer
(:mod:`triton_disagg.kv.device_staging`).

Names. Block ``i`` of a token sequence (tokens ``i*bs .. (i+1)*bs - 1``) is named by
``blake2b(parent || tokens || fingerprint || salt, digest_size=8)`` read as an unsigned
64-bit integer, where ``parent`` is block ``i-1``'s name (nothing for block 0). A name thus
stands for the whole prefix up to the end of its block, computed by one engine
(``fingerprint``: :func:`cache_fingerprint` of the weights and KV layout) for one tenant
(``salt``: the request's ``cache_salt``; None and ``""`` differ). A KV-aware router calls
:func:`block_hashes` on a request's token ids to name the blocks a server would reuse.

The prefix cache (:class:`PrefixCache`; the default, ``kv_cache.prefix_caching``). A full
block enters it (:meth:`BlockPool.cache_blocks`) once its KV is written, under its name,
and is shared by reference count: a new sequence takes the blocks of its cached prefix
(:meth:`BlockPool.take`) instead of computing them. When the last reference goes, the block
is parked at the tail of the cache's LRU list, still named and reusable, and counts as
free: an allocation takes never-cached free blocks first and evicts parked ones, oldest
first, only when those run out, so the cache never makes an allocation fail that would
succeed without it. vLLM v1's KV cache manager (``BlockPool``, ``FreeKVCacheBlockQueue``)
is the reference.

Invariants: every block id in ``[0, num_total)`` is exactly one of: free (reference count
0, on the free list once), parked (count 0, named, on the LRU list once), or used (count
>= 1, held by a live sequence or handle, maybe named); ``num_used + num_free == num_total``
(``num_free`` counts parked blocks); only full blocks are named, and a named block is never
written again; ``name -> block`` and ``block -> name`` are inverse maps (a second block
computed for the same name stays private); equal inputs give equal names in every process
(no per-process hash seed; token ids as fixed 8-byte little-endian words, the salt
length-prefixed); a listener hears ``stored`` for each name entering, ``removed`` for each
evicted one and ``cleared`` when all are forgotten, in that order, so its view equals the
cache's names; a failed :meth:`BlockPool.allocate` or :meth:`BlockPool.take` changes
nothing. The pool knows nothing about models: it stores and copies bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

import numpy as np

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


_NO_SALT = b"\x00"        # no salt given; a given salt is b"\x01" + length + utf-8 bytes


def hash_block(parent: int | None, token_ids: Sequence[int], fingerprint: bytes,
               salt: str | None = None) -> int:
    """The name of one full block of ``token_ids`` following the block named ``parent``
    (None: the first block)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" if parent is None else b"\x01" + struct.pack("<Q", parent))
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    h.update(struct.pack("<I", len(fingerprint)) + fingerprint)
    if salt is None:
        h.update(_NO_SALT)
    else:
        encoded = salt.encode()
        h.update(b"\x01" + struct.pack("<I", len(encoded)) + encoded)
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], tokens_per_block: int, fingerprint: bytes,
                 salt: str | None = None, parent: int | None = None) -> list[int]:
    """One unsigned 64-bit name per FULL block of ``token_ids``, chained from ``parent``
    (None: ``token_ids`` start the sequence; else the name of the block before them)."""
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)              # [n]
    full = len(ids) // tokens_per_block
    names: list[int] = []
    for block in ids[:full * tokens_per_block].reshape(full, tokens_per_block):  # [full, bs]
        parent = hash_block(parent, block, fingerprint, salt)
        names.append(parent)
    return names


def cache_fingerprint(engine_fingerprint: str, tokens_per_block: int, kv_dtype: str) -> bytes:
    """The ``fingerprint`` of an engine's cache: its weights and build (``engine.json``'s
    fingerprint) and the KV layout its pool uses (a different block size or KV dtype never
    shares a name)."""
    return hashlib.sha256(f"{engine_fingerprint}|{tokens_per_block}|{kv_dtype}".encode()
                          ).digest()[:16]


class PrefixCache:
    """Named full blocks of one pool, an LRU of the unheld ones, and the cache's counters."""

    def __init__(self, tokens_per_block: int, events: BlockEvents | None = None):
        self.tokens_per_block = tokens_per_block
        self.events = events
        self._block_of: dict[int, int] = {}          # name -> block
        self._name_of: dict[int, int] = {}           # block -> name
        self._parked: OrderedDict[int, None] = OrderedDict()   # unheld named blocks, oldest first
        self.query_tokens = 0       # prompt tokens looked up (disagg_prefix_cache_queries_total)
        self.hit_tokens = 0         # of which the cache held the KV (..._hits_total)
        self.prefilled_tokens = 0   # of the others, those computed here, not fetched (..._prefilled_total)
        self.evicted_blocks = 0     # named blocks given to other KV (..._evictions_total)

    @property
    def num_cached(self) -> int:
        """Blocks holding a named prefix, held or parked."""
        return len(self._block_of)

    @property
    def num_parked(self) -> int:
        """Named blocks no sequence holds: free for an allocation, at the cost of their KV."""
        return len(self._parked)

    def match(self, names: Sequence[int]) -> list[int]:
        """The blocks of the longest leading run of ``names`` the cache holds."""
        blocks = []
        for name in names:
            block = self._block_of.get(name)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def count_query(self, prompt_tokens: int, hit_tokens: int, fetched: bool = False) -> None:
        """A lookup of ``prompt_tokens`` of which the cache held ``hit_tokens``; the rest
        are prefilled here, or ``fetched`` from the instance that prefilled them."""
        self.query_tokens += prompt_tokens
        self.hit_tokens += hit_tokens
        if not fetched:
            self.prefilled_tokens += prompt_tokens - hit_tokens

    def store(self, blocks: Sequence[int], names: Sequence[int], parent: int | None,
              token_ids: Sequence[int]) -> None:
        """Name full ``blocks`` (their KV written) by ``names``; ``parent``: the name before
        the first; ``token_ids``: their tokens, ``tokens_per_block`` per block. A name
        already held by another block, or a block already named, is left as it is."""
        bs = self.tokens_per_block
        run: list[int] = []
        run_start = 0
        for i, (block, name) in enumerate(zip(blocks, names, strict=True)):
            if name in self._block_of or block in self._name_of:
                self._announce(run, parent if run_start == 0 else names[run_start - 1],
                               token_ids[run_start * bs:(run_start + len(run)) * bs])
                run, run_start = [], i + 1
                continue
            self._block_of[name] = block
            self._name_of[block] = name
            run.append(name)
        self._announce(run, parent if run_start == 0 else names[run_start - 1],
                       token_ids[run_start * bs:(run_start + len(run)) * bs])

    def _announce(self, names: list[int], parent: int | None, token_ids: Sequence[int]) -> None:
        if names and self.events is not None:
            self.events.stored(list(names), parent, [int(t) for t in token_ids],
                               self.tokens_per_block)

    def park(self, block: int) -> bool:
        """The last reference to ``block`` went: keep it at the LRU tail if it is named
        (True); False: it is not cached and goes back to the free list."""
        if block not in self._name_of:
            return False
        self._parked[block] = None
        return True

    def unpark(self, block: int) -> None:
        """A hit took ``block`` (parked) back into use."""
        del self._parked[block]

    def evict(self, n: int) -> list[int]:
        """Forget the ``n`` least recently parked blocks and return them (``n`` <= parked)."""
        blocks = [self._parked.popitem(last=False)[0] for _ in range(n)]
        names = [self._name_of.pop(b) for b in blocks]
        for name in names:
            del self._block_of[name]
        self.evicted_blocks += len(blocks)
        if names and self.events is not None:
            self.events.removed(names)
        return blocks

    def clear(self) -> list[int]:
        """Forget every name; return the parked blocks (now plain free blocks). Held blocks
        stay with their holders, unnamed: they go back to the free list when released."""
        parked = list(self._parked)
        self._parked.clear()
        self._block_of.clear()
        self._name_of.clear()
        if self.events is not None:
            self.events.cleared()
        return parked


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

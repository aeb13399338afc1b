"""The prefix cache of one block pool: the names of full KV blocks (a chained 64-bit hash
per block), which blocks hold which named prefix, and the least-recently-used order of those
no sequence holds.

Names. Block ``i`` of a token sequence (tokens ``i*bs .. (i+1)*bs - 1``) is named by
``blake2b(parent || tokens || fingerprint || salt, digest_size=8)`` read as an unsigned
64-bit integer, where ``parent`` is block ``i-1``'s name (nothing for block 0). A name thus
stands for the whole prefix up to the end of its block, computed by one engine
(``fingerprint``: :func:`cache_fingerprint` of the weights and KV layout) for one tenant
(``salt``: the request's ``cache_salt``; None and ``""`` differ). A KV-aware router calls
:func:`block_hashes` on a request's token ids to name the blocks a server would reuse.

The cache. A block enters it (:meth:`PrefixCache.store`) once its KV is written, under its
name. While sequences or handles hold it (reference count >= 1) it is shared and never
written again (it is full); when the last reference goes, the pool parks it here
(:meth:`PrefixCache.park`) at the LRU tail, still named and still reusable; a later hit
takes it back (:meth:`PrefixCache.unpark`). Only an allocation that finds no never-cached
free block evicts (:meth:`PrefixCache.evict`), oldest first. vLLM v1's KV cache manager
(``BlockPool``, ``FreeKVCacheBlockQueue``) is the reference.

Invariants: only full blocks are named (a partial tail block has no name); equal inputs
give equal names in every process (no per-process hash seed); the encoding is unambiguous
(token ids as fixed 8-byte little-endian words, the salt length-prefixed).
``name -> block`` and ``block -> name`` are inverse maps (a name has one block; a second
block computed for the same name stays private); every parked block is named; a listener
hears ``stored`` for each name entering, ``removed`` for each evicted one and ``cleared``
when all are forgotten, in that order, so its view equals the cache's names.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from triton_disagg.engine.block_pool import BlockEvents

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

    def __init__(self, tokens_per_block: int, events: "BlockEvents | None" = None):
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

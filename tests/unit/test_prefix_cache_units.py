"""The prefix cache's parts without a model: block names (prefix_cache), the pool's sharing,
parking and eviction (block_pool + prefix_cache), and the events it announces."""

import numpy as np
import pytest

from triton_disagg.engine.block_pool import BlockPool, BlockTable, KVCacheFullError
from triton_disagg.engine.block_pool import block_hashes, cache_fingerprint, hash_block
from triton_disagg.kv.layout import BlockGeometry

GEOMETRY = BlockGeometry(num_layers=1, num_kv_heads=1, head_dim=2, tokens_per_block=4,
                         dtype="float32")
FP = cache_fingerprint("engine-a", 4, "float32")


class Recorder:
    """A BlockEvents listener that keeps what it heard and the set of names it implies."""

    def __init__(self):
        self.heard: list[tuple] = []
        self.names: set[int] = set()

    def stored(self, block_hashes, parent_hash, token_ids, block_size):
        assert len(token_ids) == len(block_hashes) * block_size
        self.heard.append(("stored", list(block_hashes), parent_hash, list(token_ids)))
        self.names |= set(block_hashes)

    def removed(self, block_hashes):
        self.heard.append(("removed", list(block_hashes)))
        self.names -= set(block_hashes)

    def cleared(self):
        self.heard.append(("cleared",))
        self.names.clear()


def test_names_are_chained_unsigned_64_bit_per_full_block():
    tokens = list(range(10, 21))                       # 11 tokens: 2 full blocks of 4
    names = block_hashes(tokens, 4, FP)
    assert len(names) == 2 and all(isinstance(n, int) and 0 <= n < 2**64 for n in names)
    assert names == block_hashes(tokens[:8], 4, FP)     # the partial tail has no name
    assert names[0] == hash_block(None, tokens[:4], FP)
    assert names[1] == hash_block(names[0], tokens[4:8], FP)
    # Continuing from a parent gives the names of the whole sequence.
    assert block_hashes(tokens[4:8], 4, FP, parent=names[0]) == names[1:]
    # The same block after another prefix, another engine, another salt: other names.
    assert block_hashes([0] * 4 + tokens[4:8], 4, FP)[1] != names[1]
    assert block_hashes(tokens, 4, cache_fingerprint("engine-b", 4, "float32")) != names
    assert cache_fingerprint("engine-a", 8, "float32") != FP
    assert cache_fingerprint("engine-a", 4, "float16") != FP
    salted = block_hashes(tokens, 4, FP, salt="tenant-1")
    assert salted != names and block_hashes(tokens, 4, FP, salt="") != names
    assert salted == block_hashes(tokens, 4, FP, salt="tenant-1")
    assert block_hashes([], 4, FP) == [] and block_hashes([1, 2, 3], 4, FP) == []


def test_a_released_cached_block_is_parked_free_and_reused_by_a_hit():
    events = Recorder()
    pool = BlockPool(GEOMETRY, 6, events=events)
    tokens = list(range(1, 10))
    names = block_hashes(tokens, 4, FP)
    table = BlockTable(4)
    assert table.reserve(pool, 9, names) == 0           # nothing cached yet
    pool.cache_blocks(table.block_ids[:2], names, None, tokens[:8])
    assert events.heard == [("stored", names, None, tokens[:8])]
    assert pool.num_cached == 2 and pool.num_used == 3
    table.release(pool)
    assert pool.num_used == 0 and pool.num_free == 6 and pool.num_cached == 2
    second = BlockTable(4)
    assert second.reserve(pool, 12, names) == 8         # both named blocks, 1 new
    assert second.block_ids[:2] == pool.match(names) and second.num_tokens == 8
    assert pool.num_used == 3 and pool.refcount(second.block_ids[0]) == 1
    third = BlockTable(4)                               # a sharer while the second holds them
    assert third.reserve(pool, 5, names[:1]) == 4
    assert pool.refcount(second.block_ids[0]) == 2 and third.block_ids[0] == second.block_ids[0]
    second.release(pool)
    third.release(pool)
    assert pool.num_used == 0 and pool.num_cached == 2


def test_eviction_only_when_needed_least_recently_parked_first_tail_before_prefix():
    events = Recorder()
    pool = BlockPool(GEOMETRY, 5, events=events)
    a, b = list(range(1, 9)), list(range(50, 58))
    for tokens in (a, b):                               # a parked before b
        table = BlockTable(4)
        table.reserve(pool, 8)
        pool.cache_blocks(table.block_ids, block_hashes(tokens, 4, FP), None, tokens)
        table.release(pool)
    assert pool.num_cached == 4 and pool.num_free == 5
    (fresh,) = pool.allocate(1)                         # a never-cached block goes first
    assert pool.num_cached == 4 and pool.cache.evicted_blocks == 0
    pool.allocate(1)                                    # evicts a's tail, not its first block
    na, nb = block_hashes(a, 4, FP), block_hashes(b, 4, FP)
    assert events.heard[-1] == ("removed", [na[1]])
    assert pool.match(na) == pool.match(na[:1]) and len(pool.match(nb)) == 2
    pool.allocate(1)
    assert events.heard[-1] == ("removed", [na[0]]) and pool.match(na) == []
    assert pool.cache.evicted_blocks == 2 and events.names == set(nb)
    with pytest.raises(KVCacheFullError):
        pool.allocate(3)
    assert pool.num_cached == 2 and pool.num_free == 2  # a failed allocation changes nothing
    pool.clear_cache()
    assert events.heard[-1] == ("cleared",) and pool.num_cached == 0 and pool.num_free == 2
    assert pool.match(nb) == []


def test_take_is_all_or_nothing_and_counts_parked_hits_as_free():
    pool = BlockPool(GEOMETRY, 4)
    tokens = list(range(1, 9))
    names = block_hashes(tokens, 4, FP)
    table = BlockTable(4)
    table.reserve(pool, 8)
    pool.cache_blocks(table.block_ids, names, None, tokens)
    table.release(pool)
    held = pool.allocate(2)                            # the 2 never-cached blocks
    hits = pool.match(names)
    with pytest.raises(KVCacheFullError):
        pool.take(hits, 1)                             # 2 parked + 1 new > 2 free
    assert pool.num_used == 2 and pool.num_cached == 2 and pool.match(names) == hits
    assert pool.take(hits, 0) == hits and pool.num_free == 0
    pool.free(hits + held)
    assert pool.num_used == 0


def test_a_second_block_for_a_cached_name_stays_private():
    events = Recorder()
    pool = BlockPool(GEOMETRY, 4, events=events)
    tokens = list(range(1, 9))
    names = block_hashes(tokens, 4, FP)
    first, second = pool.allocate(2), pool.allocate(2)
    pool.cache_blocks(first, names, None, tokens)
    pool.cache_blocks(second[:1] + first[1:], names, None, tokens)   # nothing new
    assert len(events.heard) == 1 and pool.match(names) == first
    pool.free(second)
    assert pool.num_cached == 2 and sorted(pool._free) == sorted(second)
    pool.free(first)


def test_the_cache_never_refuses_an_allocation_a_cacheless_pool_grants():
    """Random allocations, hits and frees on a pool with the cache and on one without:
    the one with the cache grants every request the other grants."""
    rng = np.random.default_rng(0)
    cached, plain = BlockPool(GEOMETRY, 12), BlockPool(GEOMETRY, 12, prefix_caching=False)
    assert plain.cache is None and plain.match([1, 2]) == []
    prompts = [rng.integers(0, 5, 4 * int(rng.integers(1, 4))).tolist() for _ in range(6)]
    live: list[tuple[BlockTable, BlockTable]] = []
    for _ in range(400):
        if live and rng.random() < 0.45:
            with_cache, without = live.pop(int(rng.integers(len(live))))
            with_cache.release(cached)
            without.release(plain)
            continue
        prompt = prompts[int(rng.integers(len(prompts)))]
        names = block_hashes(prompt, 4, FP)
        tokens = len(prompt) + int(rng.integers(0, 9))
        without = BlockTable(4)
        try:
            without.reserve(plain, tokens)
        except KVCacheFullError:
            continue
        with_cache = BlockTable(4)
        hit = with_cache.reserve(cached, tokens, names)
        full = len(prompt) // 4
        cached.cache_blocks(with_cache.block_ids[:full], names[:full], None, prompt[:full * 4])
        assert hit % 4 == 0 and with_cache.capacity >= tokens
        live.append((with_cache, without))
        assert cached.num_used <= plain.num_used
    for with_cache, without in live:
        with_cache.release(cached)
        without.release(plain)
    assert cached.num_used == plain.num_used == 0 and cached.cache.evicted_blocks > 0

"""BlockPool / BlockTable: no block lost or double-freed, all-or-nothing allocation, sizing."""

import numpy as np
import pytest

from triton_disagg.errors import UserError
from triton_disagg.engine.block_pool import BlockPool, BlockTable, KVCacheFullError
from triton_disagg.kv.layout import BlockGeometry

GEOMETRY = BlockGeometry(num_layers=2, num_kv_heads=2, head_dim=4, tokens_per_block=4,
                         dtype="float32")


def check_invariants(pool: BlockPool, held: dict[int, int]) -> None:
    """``held`` maps block id -> references the test holds."""
    assert pool.num_used + pool.num_free == pool.num_total
    assert pool.num_used == len(held)
    assert sorted(pool._free) == sorted(set(range(pool.num_total)) - set(held))
    for block, refs in held.items():
        assert pool.refcount(block) == refs


def test_pool_is_one_contiguous_array_with_block_sized_rows():
    pool = BlockPool(GEOMETRY, 5)
    assert pool.array.shape == (5, 2, 2, 4, 2, 4)
    assert pool.array.flags.c_contiguous and pool.array.dtype == np.float32
    assert pool.array[1].nbytes == GEOMETRY.block_nbytes
    assert BlockPool(BlockGeometry(2, 2, 4, 4, "float16"), 1).array.dtype == np.float16


def test_random_allocate_incref_free_keeps_every_block_accounted():
    rng = np.random.default_rng(0)
    pool = BlockPool(GEOMETRY, 17)
    held: dict[int, int] = {}
    for _ in range(2000):
        op = rng.integers(3)
        if op == 0:
            n = int(rng.integers(0, 6))
            if n > pool.num_free:
                with pytest.raises(KVCacheFullError):
                    pool.allocate(n)
            else:
                ids = pool.allocate(n)
                assert len(set(ids)) == n and not set(ids) & set(held)
                held.update({b: 1 for b in ids})
        elif held:
            some = [int(b) for b in rng.choice(list(held), size=min(3, len(held)), replace=False)]
            if op == 1:
                pool.incref(some)
                for b in some:
                    held[b] += 1
            else:
                pool.free(some)
                for b in some:
                    held[b] -= 1
                    if held[b] == 0:
                        del held[b]
        check_invariants(pool, held)
    for block, refs in list(held.items()):
        pool.free([block] * refs)
    check_invariants(pool, {})


def test_full_pool_raises_and_changes_nothing():
    pool = BlockPool(GEOMETRY, 4)
    first = pool.allocate(3)
    with pytest.raises(KVCacheFullError, match="need 2 KV blocks, 1 of 4"):
        pool.allocate(2)
    check_invariants(pool, {b: 1 for b in first})
    assert pool.allocate(1) not in first


def test_double_free_and_foreign_ids_raise_and_change_nothing():
    pool = BlockPool(GEOMETRY, 4)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([a])
    with pytest.raises(ValueError, match="more times"):
        pool.free([b, b])
    with pytest.raises(ValueError, match=r"in \[0, 4\)"):
        pool.free([7])
    with pytest.raises(ValueError, match="not allocated"):
        pool.incref([a])
    check_invariants(pool, {b: 1})


def test_sizing_from_a_byte_budget():
    assert GEOMETRY.block_nbytes == 2 * 2 * 4 * 2 * 4 * 4
    assert BlockPool.blocks_for_budget(GEOMETRY, 10 * GEOMETRY.block_nbytes + 5) == 10
    assert BlockPool.from_budget(GEOMETRY, 3 * GEOMETRY.block_nbytes).num_total == 3
    with pytest.raises(UserError, match="kv_cache.max_size"):
        BlockPool.from_budget(GEOMETRY, GEOMETRY.block_nbytes - 1)


def test_read_and_write_blocks_round_trip():
    pool = BlockPool(GEOMETRY, 4)
    ids = pool.allocate(2)
    data = np.random.default_rng(0).standard_normal((2, *GEOMETRY.block_shape)).astype(np.float32)
    pool.write_blocks(ids[::-1], data)
    np.testing.assert_array_equal(pool.read_blocks(ids), data[::-1])
    with pytest.raises(ValueError):
        pool.write_blocks(ids, data[:1])


def test_block_table_reserves_blocks_as_tokens_grow():
    pool = BlockPool(GEOMETRY, 4)
    table = BlockTable(4)
    assert table.blocks_needed(1) == 1 and table.blocks_needed(9) == 3
    table.reserve(pool, 5)
    table.advance(5)
    assert len(table.block_ids) == 2 and table.blocks_needed(3) == 0 and table.blocks_needed(4) == 1
    with pytest.raises(ValueError, match="do not fit"):
        table.advance(4)
    with pytest.raises(KVCacheFullError):
        table.reserve(pool, 100)
    assert len(table.block_ids) == 2 and pool.num_used == 2
    table.release(pool)
    assert pool.num_used == 0 and table.block_ids == [] and table.num_tokens == 0

"""The KV index: leading-block overlap from stored/removed/cleared events, the bound per
publisher (the oldest stored forgotten first), freshness (heartbeats, staleness, gaps and
restarts forget what was known), forget()."""

from __future__ import annotations

from triton_disagg.routing.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                             KVEventBatch)
from triton_disagg.routing.kv_index import KvIndex


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stored(*hashes: int) -> KVEventBatch:
    return KVEventBatch(0.0, [BlockStored(list(hashes), None, [0] * len(hashes), 1, None, None)])


def test_overlap_counts_leading_blocks_only():
    index = KvIndex()
    index.batch("a", stored(1, 2, 3, 5))
    assert index.overlap("a", [1, 2, 3, 4, 5]) == 3       # 4 missing: 5 does not count
    assert index.overlap("a", [2, 3]) == 2
    assert index.overlap("a", [9, 1]) == 0
    assert index.overlap("b", [1]) == 0                   # another publisher knows nothing


def test_removed_and_cleared_take_blocks_out():
    index = KvIndex()
    index.batch("a", stored(1, 2, 3))
    index.batch("a", KVEventBatch(0.0, [BlockRemoved([2], None)]))
    assert index.overlap("a", [1, 2, 3]) == 1
    index.batch("a", KVEventBatch(0.0, [BlockRemoved([77], None)]))   # unknown: no effect
    index.batch("a", KVEventBatch(0.0, [AllBlocksCleared()]))
    assert index.overlap("a", [1]) == 0 and index.blocks("a") == 0


def test_the_bound_forgets_the_oldest_stored_first():
    index = KvIndex(max_blocks=4)
    index.batch("a", stored(1, 2, 3))
    index.batch("a", stored(1))                            # stored again: newest now
    index.batch("a", stored(4, 5))                         # 6 > 4: 2 and 3 go, not 1
    assert index.blocks("a") == 4
    assert index.overlap("a", [1]) == 1 and index.overlap("a", [2]) == 0
    assert index.overlap("a", [4, 5]) == 2
    index.batch("b", stored(*range(100, 110)))             # the bound is per publisher
    assert index.blocks("b") == 4 and index.blocks("a") == 4


def test_fresh_while_batches_arrive_stale_after_the_window():
    clock = Clock()
    index = KvIndex(stale_seconds=3.0, clock=clock)
    assert not index.fresh("a")                            # never heard from
    index.batch("a", KVEventBatch(0.0, []))                # a heartbeat
    assert index.fresh("a")
    clock.now += 3.5
    assert not index.fresh("a")
    index.batch("a", KVEventBatch(0.0, []))
    assert index.fresh("a")


def test_a_gap_or_restart_forgets_and_distrusts_for_the_window():
    clock = Clock()
    index = KvIndex(stale_seconds=3.0, clock=clock)
    index.batch("a", stored(1, 2))
    index.gap("a", 4)
    assert index.overlap("a", [1]) == 0 and not index.fresh("a")
    assert index.counts("a") == (1, 4)
    index.batch("a", stored(7))                            # what it says from now on counts
    assert index.overlap("a", [7]) == 1 and not index.fresh("a")
    clock.now += 3.5
    index.batch("a", KVEventBatch(0.0, []))
    assert index.fresh("a")
    index.restarted("a")
    assert index.blocks("a") == 0 and not index.fresh("a")


def test_forget_drops_a_publisher():
    index = KvIndex()
    index.batch("a", stored(1))
    index.forget("a")
    assert index.overlap("a", [1]) == 0 and index.counts("a") == (0, 0)

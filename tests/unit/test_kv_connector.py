"""The KV connector factory: each ``kv_cache.strategy`` gives its implementation behind one
interface, an unknown one is a clear error, and KV computed in device memory is staged
through the host array around the handoff."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from kv_peers import FP, HD, KEY, KVH, L, CountingPool, make_pool, no_leaked_shm  # noqa: F401
from triton_disagg.errors import UserError
from triton_disagg.kv.connector import STRATEGIES, HandoffBusy, KVConnector, PoolBuffer, strategy
from triton_disagg.kv.connector_factory import make_connector
from triton_disagg.kv.device_staging import DeviceStaging
from triton_disagg.kv.layout import BlockGeometry
from triton_disagg.kv.handle import HandleError


def _make(name: str, free_blocks=None) -> KVConnector:
    pool = PoolBuffer(np.zeros((4, L, 2, 4, KVH, HD), np.float32))
    return make_connector(name, pool, "conntest_0_0", KEY, FP, 30.0, free_blocks)


@pytest.mark.parametrize("name, module, cls", [
    ("direct_transfer", "triton_disagg.kv.nixl", "NixlConnector"),
    ("host_memory", "triton_disagg.kv.host_memory", "HostMemoryConnector")])
def test_each_strategy_gives_its_implementation(name, module, cls):
    if name == "direct_transfer":
        pytest.importorskip("nixl")
    for free_blocks in (None, CountingPool().free):          # generation, then context
        connector = _make(name, free_blocks)
        try:
            assert isinstance(connector, KVConnector) and connector.strategy == name
            assert (type(connector).__module__, type(connector).__name__) == (module, cls)
        finally:
            connector.close()
    assert strategy(name).name == name and set(STRATEGIES) == {"direct_transfer", "host_memory"}


def test_an_unknown_strategy_is_a_clear_error():
    with pytest.raises(UserError, match="kv_cache.strategy: 'rdma_magic' is not one of "
                                        "direct_transfer, host_memory"):
        _make("rdma_magic")
    with pytest.raises(UserError, match="is not one of"):
        strategy(None)


def test_strategy_properties_replace_name_comparisons():
    assert strategy("host_memory").needs_one_host and not strategy("direct_transfer").needs_one_host
    assert strategy("direct_transfer").reads_peer_memory
    assert not strategy("host_memory").reads_peer_memory


class FakeDeviceKV:
    """Stands in for GPU memory (none on this machine): an array the "runner" writes, copied
    to and from rows of a staging buffer as the torch runner does on CUDA."""

    def __init__(self, blocks: int):
        self.memory, self.calls = np.zeros((blocks, L, 2, 4, KVH, HD), np.float32), []

    def blocks_to_host(self, block_ids, host, rows, layers=None):
        span = slice(None) if layers is None else slice(layers.start, layers.stop)
        self.calls.append(("to_host", list(block_ids), list(rows)))
        host[rows, span] = self.memory[block_ids, span]

    def blocks_to_device(self, block_ids, host, rows):
        self.calls.append(("to_device", list(block_ids), list(rows)))
        self.memory[block_ids] = host[rows]


@pytest.mark.parametrize("name", ["host_memory", "direct_transfer"])
def test_kv_in_device_memory_is_staged_through_a_bounded_buffer(name):
    """Context: the exported blocks are copied device -> staging rows before the transport
    reads them, and the handoff's end frees rows and device blocks; generation: fetched
    rows are copied to the device before poll reports the fetch done, then freed (only the
    rows of the blocks it fetches, when generation's cache holds the first). The device
    bytes arrive where the host ones would; the buffer has 3 rows for 8 blocks."""
    if name == "direct_transfer":
        pytest.importorskip("nixl")
    geometry = BlockGeometry(L, KVH, HD, 4, "float32")
    blocks = CountingPool()
    src = FakeDeviceKV(8)
    src.memory[:] = np.random.default_rng(0).standard_normal(src.memory.shape)
    out = DeviceStaging(src, geometry, 3, blocks.free)
    context = make_connector(name, PoolBuffer(out.array, out), "conntest_0_0", KEY, FP, 30.0,
                             out.freeing())
    dst = FakeDeviceKV(8)
    into = DeviceStaging(dst, geometry, 3)
    generation = make_connector(name, PoolBuffer(into.array, into), "conntest_0_0", KEY, FP,
                                30.0)
    try:
        blocks.take([6, 0])
        data = context.export([6, 0], 7)
        assert src.calls == [("to_host", [6, 0], [0, 1])]
        stats = _finished(generation.start_fetch(generation.decode(data), [5, 3, 2]))
        assert stats.nbytes == 2 * generation.geometry.block_nbytes
        assert dst.calls == [("to_device", [5, 3], [0, 1])]
        assert dst.memory[[5, 3]].tobytes() == src.memory[[6, 0]].tobytes()
        assert not dst.memory[[0, 1, 2, 4, 6, 7]].any()        # nothing else written
        assert into.num_free == 3                               # the fetch's rows are back
        end = time.monotonic() + 10     # NIXL: the context frees on the fetch's notification
        while blocks.state()["used"] and time.monotonic() < end:
            time.sleep(0.01)
        assert blocks.state()["used"] == 0 and not blocks.errors and out.num_free == 3
        blocks.take([6, 0])                  # again, generation's cache holding block 4's KV
        data = context.export([6, 0], 7)
        _finished(generation.start_fetch(generation.decode(data), [4, 7], cached_blocks=1))
        assert dst.calls[-1][:2] == ("to_device", [7]) and not dst.memory[4].any()
        assert dst.memory[7].tobytes() == src.memory[0].tobytes() and into.num_free == 3
        end = time.monotonic() + 10
        while blocks.state()["used"] and time.monotonic() < end:
            time.sleep(0.01)
        assert blocks.state()["used"] == 0 and out.num_free == 3
        blocks.take([1, 2, 3, 4])                      # 4 blocks: more than the 3 rows
        with pytest.raises(HandoffBusy, match="staging buffer has 3 of 3 blocks free"):
            context.export([1, 2, 3, 4], 13)
        assert blocks.state()["used"] == 0 and out.num_free == 3   # given back at once
    finally:
        context.close()
        generation.close()


def test_a_host_memory_export_round_trips_through_the_interface():
    """Export (context) -> decode and start_fetch + poll (generation), then the handle is
    spent; a handle of the other strategy is refused before anything moves."""
    src, blocks = make_pool(3, 4, 4, "float32"), CountingPool()
    context = make_connector("host_memory", PoolBuffer(src), "conntest_0_0", KEY, FP, 30.0,
                             blocks.free)
    generation = _make("host_memory")
    try:
        blocks.take([2, 0])
        data = context.export([2, 0], 7)
        assert blocks.state()["used"] == 0 and not blocks.errors     # staged, then freed
        handle = generation.decode(data)
        transfer = generation.start_fetch(handle, [1, 3, 2])         # the first 2 are filled
        stats = _finished(transfer)
        assert stats.nbytes == 2 * handle.geometry.block_nbytes
        assert generation.pool.array[[1, 3]].tobytes() == src[[2, 0]].tobytes()
        assert context.expired_total() == 0
        other = make_connector("direct_transfer", PoolBuffer(src), "x", KEY, FP, 30.0) \
            if _has_nixl() else None
        if other is not None:
            try:
                with pytest.raises(HandleError, match="set up for direct_transfer"):
                    other.decode(data)
            finally:
                other.close()
    finally:
        generation.close()
        context.close()


def _finished(transfer, limit_s: float = 20.0):
    """``transfer.poll()`` once the connector's fetch thread finished it."""
    end = time.monotonic() + limit_s
    while (stats := transfer.poll()) is None:
        assert time.monotonic() < end, "the fetch never finished"
        time.sleep(0.001)
    return stats


def _has_nixl() -> bool:
    try:
        import nixl  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("name", ["direct_transfer"])
def test_two_live_handoffs_of_a_device_kv_share_a_cached_prefix_block(name):
    """Prefix caching on a device KV: a second handoff whose prompt reuses a cached block
    that a first, still unfetched, handoff holds shares that block's staging row (it used
    to fail as "staged already" and leak its blocks); each handoff's end gives its own
    reference back, and the row is freed with the last."""
    pytest.importorskip("nixl")
    geometry = BlockGeometry(L, KVH, HD, 4, "float32")
    blocks = CountingPool()
    src = FakeDeviceKV(8)
    out = DeviceStaging(src, geometry, 4, blocks.free)
    context = make_connector(name, PoolBuffer(out.array, out), "conntest_0_0", KEY, FP, 30.0,
                             out.freeing())
    try:
        blocks.take([0, 1])                    # request A: cached prefix block 0, then 1
        first = context.export([0, 1], 7)
        blocks.take([0, 2])                    # request B: shares block 0, then 2
        second = context.export([0, 2], 7)
        assert out.num_free == 1 and blocks.state()["used"] == 3
        context.release(first)
        assert blocks.freed == [[0, 1]] and blocks.used == {0: 1, 2: 1} and out.num_free == 2
        context.release(second)
        assert blocks.state()["used"] == 0 and not blocks.errors and out.num_free == 4
    finally:
        context.close()


def test_a_device_kv_export_that_fails_gives_its_blocks_back():
    """The export owns its blocks whether it returns or raises: a staging refusal of any
    kind gives them back at once."""
    geometry = BlockGeometry(L, KVH, HD, 4, "float32")
    blocks = CountingPool()
    out = DeviceStaging(FakeDeviceKV(8), geometry, 2, blocks.free)
    blocks.take([3, 4, 5])
    with pytest.raises(HandoffBusy):
        out.hand_off([3, 4, 5])
    assert blocks.state()["used"] == 0 and out.num_free == 2
    blocks.take([3])
    assert out.hand_off([3]) == [0]
    with pytest.raises(ValueError, match="staged already"):
        out.reserve([3])                       # a fetch never shares a row
    assert out.release([0]) == [3] and out.num_free == 2


@pytest.mark.parametrize("name", ["direct_transfer", "host_memory"])
@pytest.mark.parametrize("cached", [1, 2])
def test_a_fetch_leaves_out_the_blocks_generation_holds_and_ends_the_whole_handoff(name, cached):
    """Generation's prefix cache holds the KV of the handle's first ``cached`` blocks: only
    the rest is copied, into the blocks after them (those are not written), and the handoff
    ends as a whole: every block the context leased (direct_transfer) or staged (host_memory)
    is free again. The last block is always fetched (its READ ends the lease)."""
    if name == "direct_transfer":
        pytest.importorskip("nixl")
    src, blocks = make_pool(3, 4, 4, "float32"), CountingPool()
    context = make_connector(name, PoolBuffer(src), "conntest_0_0", KEY, FP, 30.0, blocks.free)
    generation = _make(name)
    try:
        blocks.take([2, 0, 3])
        handle = generation.decode(context.export([2, 0, 3], 12))
        transfer = generation.start_fetch(handle, [1, 3, 2, 0], cached_blocks=cached)
        stats = _finished(transfer)
        assert stats.nbytes == (3 - cached) * handle.geometry.block_nbytes
        dst = generation.pool.array
        assert not dst[[1, 3][:cached]].any()                         # cached: not written
        assert dst[[1, 3, 2][cached:]].tobytes() == src[[2, 0, 3][cached:]].tobytes()
        end = time.monotonic() + 10
        while blocks.state()["used"] or (name == "host_memory"
                                         and context.staging.slots_in_use()):
            assert time.monotonic() < end, f"the handoff never ended: {blocks.state()}"
            time.sleep(0.005)
        assert not blocks.errors and context.expired_total() == 0
        with pytest.raises(ValueError, match="cannot skip"):           # the last block
            generation.start_fetch(handle, [1, 3, 2], cached_blocks=3)
        with pytest.raises(ValueError, match="cannot skip"):           # blocks that differ
            generation.start_fetch(dataclasses.replace(
                handle, geometry=dataclasses.replace(handle.geometry, tokens_per_block=2),
                num_tokens=6), [1, 3, 2], cached_blocks=1)
    finally:
        generation.close()
        context.close()

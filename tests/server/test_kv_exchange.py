"""KV exchange between real processes: NIXL READs and host shared-memory staging, and the
release of a handoff nobody will fetch (helpers and sender processes: :mod:`kv_peers`)."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np
import pytest

from kv_peers import (FP, HD, KEY, KVH, REUSED, WAIT_S, L, Peer, make_pool,  # noqa: F401
                      staging_sender, tokens_of, no_leaked_shm, receivers, sender)
from triton_disagg.errors import UserError
from triton_disagg.kv.handle import check_handle, decode, tail
from triton_disagg.kv.host_memory import HostStaging, StagingFullError, StagingReader
from triton_disagg.kv.handle import LeaseExpiredError
from triton_disagg.kv.nixl import NixlEndpoint, TransferError

# Each exchange takes seconds; a test past 2 minutes is one whose sender died mid-wait
# (pyproject's 900 s is for the tritonserver tests).
pytestmark = pytest.mark.timeout(120)


# ---- direct_transfer -----------------------------------------------------------------

def _released(state: dict) -> bool:
    """No lease left and its blocks back in the pool: the sender drops a lease, then frees
    its blocks outside the table's lock, so a state between the two shows both."""
    return state["leases"] == 0 and state["used"] == 0


def test_nixl_read_moves_exact_bytes_and_notif_releases_lease(sender, receivers):
    endpoint = receivers[0]
    handle = decode(sender.ask("export", [5, 2, 9], 10, 30.0), KEY)
    check_handle(handle, FP, endpoint.geometry, handle.num_tokens)
    stats = endpoint.fetch(handle, [0, 7, 3])
    src = make_pool(1, 16, 4, "float32")
    assert endpoint.pool[[0, 7, 3]].tobytes() == src[[5, 2, 9]].tobytes()
    assert stats.nbytes == 3 * handle.geometry.block_nbytes and stats.seconds > 0
    state = sender.wait_state(_released)
    assert state["used"] == 0 and state["freed"][-1] == [2, 5, 9]
    assert state["expired"] == 0 and not state["errors"]


def test_nixl_handles_sharing_cached_blocks_each_fetch_and_free_their_own(sender, receivers):
    """Two live leases over the same (prefix-cached) blocks: each handle is fetched, in any
    order, and each lease frees its own reference once, whichever ends first."""
    first = decode(sender.ask("export", [5, 2, 9], 10, 30.0), KEY)
    second = decode(sender.ask("export", [5, 2, 11], 12, 30.0), KEY)
    endpoint, src = receivers[0], make_pool(1, 16, 4, "float32")
    endpoint.fetch(second, [0, 1, 2])
    assert endpoint.pool[[0, 1, 2]].tobytes() == src[[5, 2, 11]].tobytes()
    state = sender.wait_state(lambda s: s["leases"] == 1)
    assert state["used"] == 3 and state["freed"][-1] == [2, 5, 11]     # 5 and 2 still held
    endpoint.fetch(first, [3, 4, 5])
    assert endpoint.pool[[3, 4, 5]].tobytes() == src[[5, 2, 9]].tobytes()
    state = sender.wait_state(_released)
    assert state["used"] == 0 and state["freed"][-1] == [2, 5, 9] and not state["errors"]
    with pytest.raises(LeaseExpiredError, match="single-use"):
        receivers[1].fetch(second, [0, 1])


def test_nixl_read_converts_tokens_per_block_and_dtype(sender, receivers):
    endpoint = receivers[1]                                  # 8 tokens per block, fp16
    handle = decode(sender.ask("export", [1, 4, 6], 11, 30.0), KEY)
    endpoint.fetch(handle, [9, 2])                           # ceil(11 / 8) = 2 blocks
    src = tokens_of(make_pool(1, 16, 4, "float32"), [1, 4, 6], 11)  # [11, L, 2, kvh, hd]
    got = tokens_of(endpoint.pool, [9, 2], 16)                      # [16, L, 2, kvh, hd]
    assert got.dtype == np.float16
    assert np.array_equal(got[:11], src.astype(np.float16))        # round to nearest fp16
    np.testing.assert_allclose(got[:11], src, rtol=1e-3, atol=1e-3)
    assert not got[11:].any()                                       # unused slots are zero
    state = sender.wait_state(_released)
    assert state["used"] == 0 and not state["errors"]


def test_nixl_read_of_unregistered_addresses_is_a_clear_error(sender, receivers):
    handle = decode(sender.ask("export", [3], 2, 30.0), KEY)
    bogus = dataclasses.replace(handle, pool_addr=handle.pool_addr + (1 << 40))
    with pytest.raises(TransferError, match="refused"):
        receivers[0].fetch(bogus, [1])
    with pytest.raises(LeaseExpiredError, match="single-use"):  # tried once here, even if
        receivers[0].fetch(handle, [1])                          # that try failed
    receivers[1].fetch(handle, [1])                          # elsewhere it still works
    assert sender.wait_state(_released)["used"] == 0


def test_replayed_handle_never_reads_another_requests_kv(sender, receivers):
    """A handle is single-use: after its READ freed the blocks and a new prefill reused
    them, replaying it (on the same receiver or another one) is refused, not answered with
    the new request's KV."""
    first = sender.ask("export", [5, 2, 9], 10, 30.0)
    receivers[0].fetch(decode(first, KEY), [0, 7, 3])
    sender.wait_state(_released)                             # the notif freed the blocks
    second = sender.ask("reuse", [5, 2, 9], 10, 30.0)        # another request got them
    fresh = NixlEndpoint("gen-fresh", np.zeros((16, L, 2, 4, KVH, HD), np.float32))
    try:
        for endpoint in (receivers[0], fresh):
            with pytest.raises(LeaseExpiredError, match="already fetched"):
                endpoint.fetch(decode(first, KEY), [1, 4, 6])
        fresh.fetch(decode(second, KEY), [1, 4, 6])          # the new owner's handle works
        assert (fresh.pool[[1, 4, 6]] == REUSED).all()
    finally:
        fresh.close()
    state = sender.wait_state(_released)
    assert state["used"] == 0 and not state["errors"]


def test_lease_expiry_reclaims_unfetched_blocks(sender, receivers):
    handle = decode(sender.ask("export", [0, 11], 5, 0.3), KEY)
    state = sender.wait_state(lambda s: s["expired"] >= 1 and _released(s))
    assert state["expired"] == 1 and state["used"] == 0 and state["leases"] == 0
    assert not state["errors"]
    with pytest.raises(LeaseExpiredError, match="expired"):
        receivers[0].fetch(handle, [4, 5])


def test_nixl_read_of_consecutive_blocks_in_one_descriptor(sender, receivers):
    endpoint = receivers[0]
    handle = decode(sender.ask("export", [12, 13, 14, 1], 16, 30.0), KEY)
    endpoint.fetch(handle, [4, 5, 6, 8])                      # runs (12, 4, 3), (1, 8, 1)
    src = make_pool(1, 16, 4, "float32")
    assert endpoint.pool[[4, 5, 6, 8]].tobytes() == src[[12, 13, 14, 1]].tobytes()
    state = sender.wait_state(_released)
    assert state["freed"][-1] == [1, 12, 13, 14] and not state["errors"]


def test_a_handle_reads_its_own_blocks_only_and_only_once(sender):
    """A peer holding a valid handle cannot READ a neighbouring block, the whole pool from
    its base, or the ticket words of other blocks, nor WRITE another block: the handle's
    metadata names its own blocks alone, under its lease's device id (its own block under
    another id is refused too). Its own blocks it reads once; after that every receiver is
    refused."""
    probe = NixlEndpoint("gen-probe", np.zeros((16, L, 2, 4, KVH, HD), np.float32))
    late = NixlEndpoint("gen-late", np.zeros((16, L, 2, 4, KVH, HD), np.float32))
    try:
        handle = decode(sender.ask("export", [6], 3, 30.0), KEY)
        size, agent = handle.geometry.block_nbytes, probe._agent
        dst = agent.scratch(16 * size).ctypes.data
        lease = handle.ticket                                         # its device id
        for addr, nbytes, dev in ((handle.pool_addr + 7 * size, size, lease),  # next block
                                  (handle.pool_addr + 5 * size, 2 * size, lease),  # straddling
                                  (handle.pool_addr, 16 * size, lease),    # the whole pool
                                  (handle.ticket_addr, 16 * 8, lease),     # every ticket word
                                  (handle.pool_addr + 6 * size, size, 0)):  # its own, id 0
            peer = agent.connect(handle.agent_name, handle.agent_metadata)
            with pytest.raises(TransferError, match="refused"):
                agent.read(peer, [(dst, nbytes, 0)], [(addr, nbytes, dev)], b"",
                           time.monotonic() + 10, "a probe")
        nixl = agent._agent                                           # a WRITE, too
        agent.connect(handle.agent_name, handle.agent_metadata)
        with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
            nixl.initialize_xfer("WRITE", nixl.get_xfer_descs([(dst, size, 0)], "DRAM"),
                                 nixl.get_xfer_descs([(handle.pool_addr + 7 * size, size,
                                                        lease)], "DRAM"),
                                 handle.agent_name, b"")
        probe.fetch(handle, [2])
        assert probe.pool[2].tobytes() == make_pool(1, 16, 4, "float32")[6].tobytes()
        sender.wait_state(_released)
        for endpoint in (probe, late):
            with pytest.raises(LeaseExpiredError, match="single-use"):
                endpoint.fetch(handle, [3])
    finally:
        probe.close()
        late.close()
    state = sender.wait_state(_released)
    assert state["used"] == 0 and not state["errors"]


def test_reexported_blocks_read_right_while_another_fetch_pins_the_peer(sender):
    """Block 3 is exported and fetched (its lease ends, its descriptor stays loaded in the
    receiver's NIXL), then re-exported in a new lease over blocks 1-4, whose last block
    alone the receiver READs (its prefix cache holds the rest) while another fetch from
    the same context is in flight. NIXL looks a range up in the loaded descriptor that
    starts last at or before it: without a device id per lease that was the ended
    lease's block 3, which does not cover block 4 (refused, and no reload could help
    while the other fetch pinned the peer)."""
    receiver = NixlEndpoint("gen-relet", np.zeros((16, L, 2, 4, KVH, HD), np.float32))
    regions = receiver.agent.registered
    try:
        receiver.fetch(decode(sender.ask("export", [3], 4, 30.0), KEY), [0])
        sender.wait_state(_released)
        other = decode(sender.ask("export", [7], 4, 30.0), KEY)
        relet = decode(sender.ask("reuse", [1, 2, 3, 4], 16, 30.0), KEY)
        peer = receiver.open_pull(other, time.monotonic())       # in flight, pinned
        deadline = time.monotonic() + WAIT_S
        receiver.read_layers(peer, other, [1], range(0, 1), deadline)
        receiver.fetch(tail(relet, 3), [5])
        assert (receiver.pool[5] == REUSED).all()
        tickets = np.zeros(1, np.int64)                           # [1] the other's word
        reg = receiver.agent.register(tickets)
        receiver.read_layers(peer, other, [1], range(1, L), deadline)
        receiver.confirm(peer, other, deadline, tickets)
        receiver.agent.unregister(reg)
        receiver.agent.unpin(peer)
        assert receiver.pool[1].tobytes() == make_pool(1, 16, 4, "float32")[7].tobytes()
        assert receiver.agent.registered == regions             # the tickets' went again
    finally:
        receiver.close()
    state = sender.wait_state(_released)
    assert state["used"] == 0 and state["exposed"] == 0 and not state["errors"]


@pytest.mark.parametrize("skew_s", [3600.0, -3600.0])
def test_lease_survives_clock_skew_between_hosts(sender, receivers, monkeypatch, skew_s):
    """The receiver's wall clock an hour off the sender's refuses nothing: a lease is
    judged by each side on its own clock."""
    expired = sender.ask("state")["expired"]                 # earlier tests' leases
    handle = decode(sender.ask("export", [10], 2, 30.0), KEY)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew_s)
    receivers[0].fetch(handle, [6])
    monkeypatch.undo()
    assert receivers[0].pool[6].tobytes() == make_pool(1, 16, 4, "float32")[10].tobytes()
    assert sender.wait_state(_released)["expired"] == expired


# ---- host_memory ---------------------------------------------------------------------

def test_host_staging_round_trip_across_processes():
    peer = Peer(staging_sender)
    try:
        raw, state = peer.out.get(timeout=WAIT_S)
        assert state["used"] == 0                            # freed right after staging
        handle = decode(raw, KEY)
        assert os.path.exists(f"/dev/shm/{handle.shm_name}")
        pool = np.zeros((10, L, 2, 4, KVH, HD), np.float32)   # 4 tokens per block, fp32
        reader = StagingReader()
        try:
            stats = reader.fetch(handle, pool, [8, 0, 2, 5, 7])  # ceil(19 / 4) = 5 blocks
            with pytest.raises(LeaseExpiredError, match="already fetched"):
                reader.fetch(handle, pool, [8, 0, 2, 5, 7])
        finally:
            reader.close()
        src = tokens_of(make_pool(2, 8, 8, "float16"), [6, 1, 3], 19)
        assert np.array_equal(tokens_of(pool, [8, 0, 2, 5, 7], 19), src.astype(np.float32))
        assert stats.nbytes == 3 * handle.geometry.block_nbytes
        assert peer.ask("state") == {"slots_in_use": 0, "expired": 0}
    finally:
        peer.stop()
    assert not os.path.exists(f"/dev/shm/{handle.shm_name}")


def test_host_staging_full_expiry_and_too_large():
    pool = make_pool(3, 4, 4, "float32")
    area = HostStaging.create("full", num_slots=2, slot_bytes=pool[0].nbytes)
    try:
        first = area.put(pool, [0, 1], 8, FP, ttl_s=0.3)
        with pytest.raises(StagingFullError, match="full"):
            area.put(pool, [2], 3, FP, ttl_s=10)
        with pytest.raises(UserError, match="raise kv_cache.max_size"):
            area.put(pool, [0, 1, 2], 9, FP, ttl_s=10)
        time.sleep(0.4)
        second = area.put(pool, [3], 2, FP, ttl_s=10)         # expired slots reclaimed
        assert area.expired_total == 1 and second.slots[0] in first.slots
        dst = np.zeros_like(pool)
        with pytest.raises(LeaseExpiredError):
            area.take(first, dst, [0, 1])
        area.take(second, dst, [2])
        assert dst[2].tobytes() == pool[3].tobytes() and area.slots_in_use() == 0
    finally:
        area.close()


def test_host_staging_same_layout_copies_each_run_of_slots_exactly():
    pool = make_pool(5, 6, 4, "float32")
    area = HostStaging.create("runs", num_slots=6, slot_bytes=pool[0].nbytes + 64)  # slack
    try:
        area.put(pool, [5], 4, FP, ttl_s=10)                  # slot 0 taken: the next start at 1
        handle = area.put(pool, [4, 0, 2, 3], 15, FP, ttl_s=10)
        dst = np.zeros_like(pool)
        area.take(handle, dst, [1, 2, 5, 0])                  # runs: slots 1-2 -> 1-2, 3 -> 5, 4 -> 0
        assert dst[[1, 2, 5, 0]].tobytes() == pool[[4, 0, 2, 3]].tobytes()
        assert not dst[[3, 4]].any()
    finally:
        area.close()


def test_concurrent_fetches_of_one_staged_handle_exactly_one_succeeds():
    """Two readers (each its own mapping of the area, as in two processes) replay one
    handle at the same moment: one gets the KV, the other is refused before it copied a
    byte (both would pass a check-then-copy that claims nothing)."""
    pool = make_pool(6, 4, 4, "float32")
    area = HostStaging.create("race", num_slots=4, slot_bytes=pool[0].nbytes)
    readers = [HostStaging.attach(area.name) for _ in range(2)]
    both_copying = threading.Barrier(2)

    class Rendezvous(np.ndarray):
        """A pool whose first write waits (up to 2 s) until the other reader writes too."""

        def __setitem__(self, key, value):
            try:
                both_copying.wait(2)
            except threading.BrokenBarrierError:
                pass
            super().__setitem__(key, value)

    try:
        handle = area.put(pool, [2, 3], 7, FP, ttl_s=30)
        results, dsts = [None, None], [np.zeros_like(pool).view(Rendezvous) for _ in range(2)]

        def fetch(i: int) -> None:
            dst = dsts[i]
            try:
                readers[i].take(handle, dst, [0, 1])
                results[i] = dst[[0, 1]].tobytes() == pool[[2, 3]].tobytes()
            except LeaseExpiredError as exc:
                results[i] = exc

        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert results.count(True) == 1, results
        refused = results.index(True) ^ 1
        assert isinstance(results[refused], LeaseExpiredError), results
        assert not dsts[refused].any() and area.slots_in_use() == 0
    finally:
        for reader in readers:
            reader.close()
        area.close()


# ---- giving back a handoff nobody will fetch (release_kv) ----------------------------

def test_a_released_nixl_lease_frees_its_blocks_at_once_and_cannot_be_fetched(sender, receivers):
    """Released by the context instance that holds it, or by another one on the host (by
    the notification a reader sends): the blocks are free long before the lease's 30 s."""
    other_context = NixlEndpoint("ctx-other", make_pool(9, 4, 4, "float32"), lambda ids: None)
    try:
        for release in (lambda raw: sender.ask("release", raw),
                        lambda raw: other_context.release(decode(raw, KEY))):
            expired = sender.ask("state")["expired"]      # earlier tests' leases
            raw = sender.ask("export", [3, 8], 7, 30.0)
            release(raw)
            state = sender.wait_state(_released, timeout=5.0)
            assert state["leases"] == 0 and state["used"] == 0 and state["expired"] == expired
            assert state["freed"][-1] == [3, 8] and not state["errors"]
            with pytest.raises(LeaseExpiredError):
                receivers[0].fetch(decode(raw, KEY), [0, 1])
        sender.ask("release", raw)             # again: nothing left to give back, no error
        assert not sender.ask("state")["errors"]
    finally:
        other_context.close()


def test_discarded_staging_slots_are_free_at_once_and_cannot_be_fetched():
    peer = Peer(staging_sender)
    try:
        raw, _ = peer.out.get(timeout=WAIT_S)
        handle = decode(raw, KEY)
        assert peer.ask("state")["slots_in_use"] == 3
        reader = StagingReader()
        try:
            reader.discard(handle)
            assert peer.ask("state") == {"slots_in_use": 0, "expired": 0}
            with pytest.raises(LeaseExpiredError, match="already fetched or reclaimed"):
                reader.fetch(handle, np.zeros((10, L, 2, 4, KVH, HD), np.float32), [0, 1, 2, 3, 4])
        finally:
            reader.close()
    finally:
        peer.stop()

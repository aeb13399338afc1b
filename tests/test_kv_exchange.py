"""KV exchange between real processes: NIXL READs, host shared-memory staging, leases, handles.

Senders run in ``spawn``-started processes that talk to the test over queues; every
wait has a timeout, and an alarm bounds each test.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

from triton_disagg.errors import UserError
from triton_disagg.kv.handle import (FORMAT_VERSION, HandleError, KVHandle, check_handle,
                                     decode, encode, to_tensor)
from triton_disagg.kv.host_staging import HostStaging, StagingFullError, StagingReader
from triton_disagg.kv.layout import BlockGeometry, convert_blocks, write_blocks
from triton_disagg.kv.leases import LeaseExpiredError, LeaseTable
from triton_disagg.kv.nixl_transfer import NixlEndpoint, TransferError

L, KVH, HD = 2, 2, 4          # tiny model: 2 layers, 2 KV heads, head size 4
FP = "f" * 64                 # engine fingerprint of both sides
KEY = b"k" * 32               # the deployment key that signs handles
WAIT_S = 60                   # bound on any single wait for another process
SPAWN = mp.get_context("spawn")
REUSED = 42.0                 # what a later request's prefill writes into reused blocks


def make_pool(seed: int, num_blocks: int, bs: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (num_blocks, L, 2, bs, KVH, HD)                  # [nb, L, 2, bs, kvh, hd]
    return rng.standard_normal(shape).astype(dtype)


def tokens_of(pool: np.ndarray, block_ids, n: int) -> np.ndarray:
    """Reference gather, token by token: ``[n, L, 2, kvh, hd]``."""
    bs = pool.shape[3]
    return np.stack([pool[block_ids[t // bs], :, :, t % bs] for t in range(n)])


class CountingPool:
    """Stands in for BlockPool's refcounts: records frees and any double free."""

    def __init__(self) -> None:
        self.used: set[int] = set()
        self.freed: list[list[int]] = []
        self.errors: list[str] = []

    def take(self, ids) -> None:
        self.used.update(ids)

    def free(self, ids) -> None:
        for b in ids:
            if b not in self.used:
                self.errors.append(f"double free of block {b}")
        self.used.difference_update(ids)
        self.freed.append(sorted(ids))

    def state(self, **extra) -> dict:
        return {"used": len(self.used), "freed": self.freed, "errors": self.errors, **extra}


# ---- sender processes ----------------------------------------------------------------

def nixl_sender(cmds, out) -> None:
    """Context side: fp32 pool, 4 tokens per block, direct_transfer."""
    pool, blocks = make_pool(1, 16, 4, "float32"), CountingPool()
    endpoint = NixlEndpoint("ctx", pool, blocks.free, poll_interval_s=0.002)
    leases = endpoint.leases
    out.put("ready")
    while True:
        cmd, *args = cmds.get(timeout=WAIT_S)
        if cmd in ("export", "reuse"):
            ids, n, ttl = args
            blocks.take(ids)
            if cmd == "reuse":                     # a new prefill writes the freed blocks
                pool[ids] = REUSED
            out.put(encode(endpoint.export(ids, n, FP, ttl), KEY))
        elif cmd == "state":
            out.put(blocks.state(expired=leases.expired_total, leases=len(leases)))
        else:
            endpoint.close()
            out.put("bye")
            return


def staging_sender(cmds, out) -> None:
    """Context side: fp16 pool, 8 tokens per block, host_memory with 4 one-block slots."""
    pool, blocks = make_pool(2, 8, 8, "float16"), CountingPool()
    area = HostStaging.create("test", num_slots=4, slot_bytes=pool[0].nbytes)
    ids = [6, 1, 3]
    blocks.take(ids)
    handle = area.put(pool, ids, 19, FP, ttl_s=30)
    blocks.free(ids)  # the pool is free as soon as the blocks are staged
    out.put((encode(handle, KEY), blocks.state()))
    while cmds.get(timeout=WAIT_S)[0] == "state":
        out.put({"slots_in_use": area.slots_in_use(), "expired": area.reap()})
    area.close()
    out.put("bye")


class Peer:
    """A spawned sender process and its two queues."""

    def __init__(self, target) -> None:
        self.cmds, self.out = SPAWN.Queue(), SPAWN.Queue()
        self.proc = SPAWN.Process(target=target, args=(self.cmds, self.out), daemon=True)
        self.proc.start()

    def ask(self, *cmd):
        self.cmds.put(cmd)
        return self.out.get(timeout=WAIT_S)

    def wait_state(self, done, timeout: float = 10.0) -> dict:
        end = time.monotonic() + timeout
        while True:
            state = self.ask("state")
            if done(state) or time.monotonic() > end:
                return state
            time.sleep(0.02)

    def stop(self) -> None:
        try:
            self.cmds.put(("stop",))
            self.proc.join(WAIT_S)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)


# ---- fixtures ------------------------------------------------------------------------

def _our_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("triton_disagg_kv_")}


@pytest.fixture(scope="module", autouse=True)
def no_leaked_shm():
    before = _our_shm()
    yield
    assert _our_shm() == before, "shared-memory staging segments leaked"


@pytest.fixture(autouse=True)
def bounded_time():
    def expire(*_):
        raise TimeoutError("test ran past 120 s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def sender():
    pytest.importorskip("nixl")
    peer = Peer(nixl_sender)
    try:
        assert peer.out.get(timeout=WAIT_S) == "ready"
        yield peer
    finally:
        peer.stop()


@pytest.fixture(scope="module")
def receivers():
    """Generation side: one pool like the sender's, one with 8 tokens per block in fp16."""
    pytest.importorskip("nixl")
    same = NixlEndpoint("gen-same", np.zeros((16, L, 2, 4, KVH, HD), np.float32))
    other = NixlEndpoint("gen-other", np.zeros((16, L, 2, 8, KVH, HD), np.float16))
    yield same, other
    same.close()
    other.close()


# ---- direct_transfer -----------------------------------------------------------------

def test_nixl_read_moves_exact_bytes_and_notif_releases_lease(sender, receivers):
    endpoint = receivers[0]
    handle = decode(sender.ask("export", [5, 2, 9], 10, 30.0), KEY)
    check_handle(handle, FP, endpoint.geometry)
    stats = endpoint.fetch(handle, [0, 7, 3])
    src = make_pool(1, 16, 4, "float32")
    assert endpoint.pool[[0, 7, 3]].tobytes() == src[[5, 2, 9]].tobytes()
    assert stats.nbytes == 3 * handle.geometry.block_nbytes and stats.seconds > 0
    state = sender.wait_state(lambda s: s["leases"] == 0)
    assert state["used"] == 0 and state["freed"][-1] == [2, 5, 9]
    assert state["expired"] == 0 and not state["errors"]


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
    state = sender.wait_state(lambda s: s["leases"] == 0)
    assert state["used"] == 0 and not state["errors"]


def test_nixl_read_of_unregistered_addresses_is_a_clear_error(sender, receivers):
    handle = decode(sender.ask("export", [3], 2, 30.0), KEY)
    bogus = dataclasses.replace(handle, pool_addr=handle.pool_addr + (1 << 40))
    with pytest.raises(TransferError, match="refused"):
        receivers[0].fetch(bogus, [1])
    with pytest.raises(LeaseExpiredError, match="single-use"):  # tried once here, even if
        receivers[0].fetch(handle, [1])                          # that try failed
    receivers[1].fetch(handle, [1])                          # elsewhere it still works
    assert sender.wait_state(lambda s: s["leases"] == 0)["used"] == 0


def test_replayed_handle_never_reads_another_requests_kv(sender, receivers):
    """A handle is single-use: after its READ freed the blocks and a new prefill reused
    them, replaying it (on the same receiver or another one) is refused, not answered with
    the new request's KV."""
    first = sender.ask("export", [5, 2, 9], 10, 30.0)
    receivers[0].fetch(decode(first, KEY), [0, 7, 3])
    sender.wait_state(lambda s: s["leases"] == 0)            # the notif freed the blocks
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
    state = sender.wait_state(lambda s: s["leases"] == 0)
    assert state["used"] == 0 and not state["errors"]


def test_lease_expiry_reclaims_unfetched_blocks(sender, receivers):
    handle = decode(sender.ask("export", [0, 11], 5, 0.3), KEY)
    state = sender.wait_state(lambda s: s["expired"] >= 1)
    assert state["expired"] == 1 and state["used"] == 0 and state["leases"] == 0
    assert not state["errors"]
    with pytest.raises(LeaseExpiredError, match="expired"):
        receivers[0].fetch(handle, [4, 5])


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


# ---- handles -------------------------------------------------------------------------

def _handle(**overrides) -> KVHandle:
    fields = dict(fingerprint=FP, geometry=BlockGeometry(L, KVH, HD, 4, "float32"),
                  num_tokens=5, strategy="host_memory", lease_id="ab12",
                  lease_deadline=time.time() + 5, shm_name="triton_disagg_kv_x",
                  slots=(0, 1))
    return KVHandle(**{**fields, **overrides})


def sign(body: bytes) -> bytes:
    """``body`` with the tag the context side appends: a handle this deployment made."""
    return body + hmac.new(KEY, body, hashlib.sha256).digest()


def test_handle_round_trip_and_clear_errors():
    nixl = _handle(strategy="direct_transfer", agent_name="ctx-1", agent_metadata=b"\x00md\xff",
                   pool_addr=4096, ticket_addr=8192, ticket=7, block_ids=(3, 0), shm_name="",
                   slots=())
    for h in (_handle(), nixl):
        assert decode(encode(h, KEY), KEY) == h and decode(to_tensor(h, KEY), KEY) == h
    good = encode(_handle(), KEY)
    with pytest.raises(HandleError, match="not a KV handle"):
        decode(b"garbage", KEY)
    with pytest.raises(HandleError, match="not a KV handle"):
        decode(np.zeros(0, np.uint8), KEY)
    with pytest.raises(HandleError, match=f"version {FORMAT_VERSION + 1}.*reads version"):
        decode(good[:4] + (FORMAT_VERSION + 1).to_bytes(2, "big") + good[6:], KEY)
    with pytest.raises(HandleError, match="truncated"):
        decode(sign(good[:20]), KEY)
    with pytest.raises(HandleError, match="corrupt"):
        decode(sign(good[:-32].replace(b'"num_tokens":5', b'"num_tokens":0')), KEY)
    with pytest.raises(HandleError, match="UINT8"):
        decode(np.zeros(4, np.int32), KEY)
    with pytest.raises(HandleError, match="same engine"):
        check_handle(_handle(), "e" * 64, BlockGeometry(L, KVH, HD, 16, "float16"))
    with pytest.raises(HandleError, match="layers, KV heads"):
        check_handle(_handle(), FP, BlockGeometry(L + 1, KVH, HD, 4, "float32"))
    check_handle(_handle(), FP, BlockGeometry(L, KVH, HD, 16, "float16"))  # receiver converts


# ---- layout and leases, in process ---------------------------------------------------

@pytest.mark.parametrize("src_bs,src_dtype,dst_bs,dst_dtype", [
    (4, "float32", 4, "float32"), (4, "float32", 3, "float16"),
    (8, "float16", 4, "float32"), (3, "float16", 8, "float16")])
def test_layout_conversion(src_bs, src_dtype, dst_bs, dst_dtype):
    src_pool, n = make_pool(4, 6, src_bs, src_dtype), 13
    src_ids = list(range(5, 5 - -(-n // src_bs), -1))
    dst_pool = np.full((8, L, 2, dst_bs, KVH, HD), 7, dst_dtype)
    dst_ids = [7, 1, 3, 0, 5][: -(-n // dst_bs)]
    write_blocks(src_pool[src_ids], n, dst_pool, dst_ids)
    want = tokens_of(src_pool, src_ids, n).astype(dst_dtype)
    assert np.array_equal(tokens_of(dst_pool, dst_ids, n), want)
    if (src_bs, src_dtype) == (dst_bs, dst_dtype):             # exact, whole blocks
        assert dst_pool[dst_ids].tobytes() == src_pool[src_ids].tobytes()
    else:
        blocks = convert_blocks(src_pool[src_ids], n, dst_bs, dst_dtype)
        assert blocks.shape == (len(dst_ids), L, 2, dst_bs, KVH, HD)
        assert not tokens_of(blocks, list(range(len(dst_ids))), len(dst_ids) * dst_bs)[n:].any()


def test_leases_free_every_block_exactly_once_under_races():
    blocks = CountingPool()
    table = LeaseTable(blocks.free)
    leases = []
    for i in range(300):
        blocks.take([i])
        leases.append(table.grant([i], ttl_s=-1.0 if i % 3 == 0 else 60.0))
    released = []

    def release_all():
        released.append(sum(table.release(lease.lease_id) for lease in leases))

    threads = [threading.Thread(target=release_all) for _ in range(4)]
    threads.append(threading.Thread(target=table.reap))
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert sum(released) + table.expired_total == 300
    assert not blocks.errors and not blocks.used and len(table) == 0
    assert sorted(b for ids in blocks.freed for b in ids) == list(range(300))
    assert table.release(leases[1].lease_id) is False and table.reap() == 0


def test_read_descriptors_cover_runs_of_consecutive_blocks():
    from triton_disagg.kv.nixl_transfer import _runs

    assert _runs([3, 4, 5, 9, 10, 2], range(6)) == [(3, 0, 3), (9, 3, 2), (2, 5, 1)]
    assert _runs([0, 1, 2], [5, 4, 3]) == [(0, 5, 1), (1, 4, 1), (2, 3, 1)]   # dst goes down
    assert _runs([7], [0]) == [(7, 0, 1)] and _runs([], []) == []


def test_nixl_read_of_consecutive_blocks_in_one_descriptor(sender, receivers):
    endpoint = receivers[0]
    handle = decode(sender.ask("export", [12, 13, 14, 1], 16, 30.0), KEY)
    endpoint.fetch(handle, [4, 5, 6, 8])                      # runs (12, 4, 3), (1, 8, 1)
    src = make_pool(1, 16, 4, "float32")
    assert endpoint.pool[[4, 5, 6, 8]].tobytes() == src[[12, 13, 14, 1]].tobytes()
    state = sender.wait_state(lambda s: s["leases"] == 0)
    assert state["freed"][-1] == [1, 12, 13, 14] and not state["errors"]

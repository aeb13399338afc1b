"""The KV exchange's in-process parts: signed handles, layout conversion, the lease table
under races, and READ descriptors."""

from __future__ import annotations

import hashlib
import hmac
import threading
import time

import numpy as np
import pytest

from kv_peers import FP, KEY, KVH, HD, L, WAIT_S, CountingPool, make_pool, tokens_of
from triton_disagg.kv.handle import (FORMAT_VERSION, HandleError, KVHandle, check_handle,
                                     decode, encode, to_tensor)
from triton_disagg.kv.layout import BlockGeometry, convert_blocks, write_blocks
from triton_disagg.kv.handle import LeaseTable


# ---- handles -------------------------------------------------------------------------

def _handle(**overrides) -> KVHandle:
    fields = dict(fingerprint=FP, geometry=BlockGeometry(L, KVH, HD, 4, "float32"),
                  num_tokens=5, strategy="host_memory", lease_id="ab12",
                  lease_seconds=5, shm_name="triton_disagg_kv_x",
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
        check_handle(_handle(), "e" * 64, BlockGeometry(L, KVH, HD, 16, "float16"), 64)
    with pytest.raises(HandleError, match="layers, KV heads"):
        check_handle(_handle(), FP, BlockGeometry(L + 1, KVH, HD, 4, "float32"), 64)
    check_handle(_handle(), FP, BlockGeometry(L, KVH, HD, 16, "float16"), 64)  # it converts


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


def test_a_renewed_lease_outlives_its_first_deadline_and_an_ended_one_is_not_renewed():
    now = [100.0]
    blocks = CountingPool()
    blocks.take([1, 2])
    table = LeaseTable(blocks.free, clock=lambda: now[0])
    lease = table.grant([1, 2], ttl_s=5.0, filling=True)
    assert table.readable() == 0
    now[0] = 104.0
    assert table.renew(lease.lease_id, 5.0, filling=False)          # now due at 109
    assert table.readable() == 1
    now[0] = 106.0
    assert table.reap() == 0 and len(table) == 1
    now[0] = 110.0
    assert table.reap() == 1 and not blocks.used
    assert table.renew(lease.lease_id, 5.0, filling=False) is False and len(table) == 0


def test_read_descriptors_cover_runs_of_consecutive_blocks():
    from triton_disagg.kv.layout import runs as _runs

    assert _runs([3, 4, 5, 9, 10, 2], range(6)) == [(3, 0, 3), (9, 3, 2), (2, 5, 1)]
    assert _runs([0, 1, 2], [5, 4, 3]) == [(0, 5, 1), (1, 4, 1), (2, 3, 1)]   # dst goes down
    assert _runs([7], [0]) == [(7, 0, 1)] and _runs([], []) == []


# ---- remote NIXL agents --------------------------------------------------------------

class FakeNixl:
    """A ``nixl_agent``'s remote-agent calls: metadata ``b"<name>:..."`` loads ``name``."""

    def __init__(self) -> None:
        self.loads: dict[str, int] = {}     # loaded agent -> metadata loaded into it
        self.removed: list[str] = []

    def add_remote_agent(self, metadata: bytes) -> bytes:
        name = metadata.split(b":")[0].decode()
        self.loads[name] = self.loads.get(name, 0) + 1
        return name.encode()

    def remove_remote_agent(self, name: str) -> None:
        del self.loads[name]
        self.removed.append(name)


def test_remote_agents_of_restarted_contexts_do_not_pile_up():
    from triton_disagg.kv.nixl_agent import RemoteAgents, TransferError
    now, nixl = [0.0], FakeNixl()
    remotes = RemoteAgents(nixl, max_peers=2, idle_s=10, max_loads=3, clock=lambda: now[0])
    for name in ("ctx-1", "ctx-2", "ctx-3"):          # a context restarts under a new name
        remotes.load(name, f"{name}:md".encode())
    assert set(nixl.loads) == {"ctx-2", "ctx-3"} and nixl.removed == ["ctx-1"]
    remotes.load("ctx-2", b"ctx-2:md2")                # used: ctx-3 is now the oldest
    remotes.load("ctx-4", b"ctx-4:md")
    assert set(nixl.loads) == {"ctx-2", "ctx-4"} and nixl.removed[-1] == "ctx-3"
    remotes.load("ctx-2", b"ctx-2:md3")                # a third handle's descriptors
    remotes.load("ctx-2", b"ctx-2:md4")                # the fourth: loaded afresh
    assert nixl.loads["ctx-2"] == 1 and nixl.removed[-1] == "ctx-2"
    now[0] = 11.0                                      # both idle past 10 s
    remotes.load("ctx-5", b"ctx-5:md")
    assert set(nixl.loads) == {"ctx-5"} and len(remotes) == 1
    with pytest.raises(TransferError, match="names agent 'ctx-6' but its metadata is"):
        remotes.load("ctx-6", b"ctx-7:md")             # metadata of another agent: not kept
    assert set(nixl.loads) == {"ctx-5"}
    remotes.forget("ctx-5")                            # after a failed READ
    remotes.forget("ctx-5")
    assert not nixl.loads and len(remotes) == 0


def test_a_remote_agent_pinned_without_end_stops_growing_at_twice_max_loads():
    """Review item 4: every handle adds descriptors (a device id per lease) and the reload at
    ``max_loads`` waits for the last unpin; under fetches that always overlap, none comes.
    At ``2 * max_loads`` loads a pinned agent takes no new one until its fetches end, and
    the next load after that reloads it."""
    from triton_disagg.kv.nixl_agent import RemoteAgents, TransferError
    nixl = FakeNixl()
    remotes = RemoteAgents(nixl, max_peers=2, idle_s=10, max_loads=2, clock=lambda: 0.0)
    for _ in range(4):                                 # each fetch starts before one ends
        remotes.load("ctx", b"ctx:md", pin=True)
    assert nixl.loads["ctx"] == 4 and not nixl.removed
    for pin in (True, False):
        with pytest.raises(TransferError, match="no new one until they end"):
            remotes.load("ctx", b"ctx:md", pin=pin)
    assert nixl.loads["ctx"] == 4
    for _ in range(3):
        remotes.unpin("ctx")
    with pytest.raises(TransferError):                 # one fetch still reads from it
        remotes.load("ctx", b"ctx:md", pin=True)
    remotes.unpin("ctx")                               # drained: the next load reloads
    remotes.load("ctx", b"ctx:md", pin=True)
    assert nixl.loads["ctx"] == 1 and nixl.removed == ["ctx"]

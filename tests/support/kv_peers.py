"""What the KV tests share: a tiny model's pools, sender processes and their fixtures.

Senders run in ``spawn``-started processes (which import this module by name) and talk
to the test over queues; every wait has a timeout (and pytest-timeout bounds each test).
Test modules import the fixtures they use from here.
"""

from __future__ import annotations

import multiprocessing as mp
from collections import Counter
import os
import threading
import time

import numpy as np
import pytest

from triton_disagg import shm
from triton_disagg.kv.handle import decode, encode
from triton_disagg.kv.host_memory import HostStaging
from triton_disagg.kv.nixl import NixlEndpoint

L, KVH, HD = 2, 2, 4          # tiny model: 2 layers, 2 KV heads, head size 4
FP = "f" * 64                 # engine fingerprint of both sides
KEY = b"k" * 32               # the deployment key that signs handles
WAIT_S = 60                   # bound on any single wait for another process
SPAWN = mp.get_context("spawn")
REUSED = 42.0                 # what a later request's prefill writes into reused blocks
SPAWNED: set[int] = set()     # pids of the sender processes the tests started


def make_pool(seed: int, num_blocks: int, bs: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (num_blocks, L, 2, bs, KVH, HD)                  # [nb, L, 2, bs, kvh, hd]
    return rng.standard_normal(shape).astype(dtype)


def tokens_of(pool: np.ndarray, block_ids, n: int) -> np.ndarray:
    """Reference gather, token by token: ``[n, L, 2, kvh, hd]``."""
    bs = pool.shape[3]
    return np.stack([pool[block_ids[t // bs], :, :, t % bs] for t in range(n)])


class CountingPool:
    """Stands in for BlockPool's refcounts: records frees and any double free. Thread-safe,
    as the pool behind a lease table's ``free_blocks`` must be (frees race there)."""

    def __init__(self) -> None:
        self.used: Counter[int] = Counter()       # block -> references (a shared block: > 1)
        self.freed: list[list[int]] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def take(self, ids) -> None:
        with self._lock:
            self.used.update(ids)

    def free(self, ids) -> None:
        with self._lock:
            for b in ids:
                if self.used[b] == 0:
                    self.errors.append(f"double free of block {b}")
            self.used.subtract(ids)
            self.used = +self.used                # drop blocks at zero
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
        elif cmd == "release":                      # a release_kv of its own handle
            endpoint.release(decode(args[0], KEY))
            out.put("released")
        elif cmd == "state":
            out.put(blocks.state(expired=leases.expired_total, leases=len(leases),
                                   exposed=endpoint.agent.exposed))
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
        SPAWNED.add(self.proc.pid)

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
    """Staging areas made by this process or its senders (other servers on the host, e.g.
    other test runs, make their own)."""
    ours = {os.getpid()} | SPAWNED
    return {n for n in os.listdir("/dev/shm")
            if n.startswith("triton_disagg_kv_") and getattr(shm.owner_of(n), "pid", 0) in ours}


@pytest.fixture(scope="module", autouse=True)
def no_leaked_shm():
    before = _our_shm()
    yield
    assert _our_shm() == before, f"shared-memory staging segments leaked: {_our_shm() - before}"


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

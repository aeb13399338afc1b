"""/dev/shm hygiene: owned names, the sweep of a killed owner's leftovers, the free-space
check before an area is created, the reader dropping a dead context's area, and a killed
tritonserver's Python-backend regions removed by ``stop``.

Creators that must die run in ``spawn``-started processes; every wait has a timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

import servers
from triton_disagg import shm
from triton_disagg.errors import UserError
from triton_disagg.kv.host_memory import HostStaging, StagingError, StagingReader

WAIT_S = 60
SPAWN = mp.get_context("spawn")
BLOCK = (1, 2, 4, 1, 4)            # one KV block: [L, 2, bs, kvh, hd], float32: 128 bytes


def pool(value: float) -> np.ndarray:
    return np.full((2, *BLOCK), value, np.float32)         # [2 blocks, L, 2, bs, kvh, hd]


def creator(out, value: float) -> None:
    """Create an area, stage one block of ``value``, hand over the handle, wait to die."""
    area = HostStaging.create("test-shm", num_slots=2, slot_bytes=pool(0)[0].nbytes)
    out.put(area.put(pool(value), [1], 4, "f" * 64, ttl_s=WAIT_S))
    time.sleep(WAIT_S)
    area.close()


class Creator:
    def __init__(self, value: float) -> None:
        self.out = SPAWN.Queue()
        self.proc = SPAWN.Process(target=creator, args=(self.out, value), daemon=True)
        self.proc.start()
        self.handle = self.out.get(timeout=WAIT_S)
        self.path = os.path.join(shm.SHM_DIR, self.handle.shm_name)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(WAIT_S)


def mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return name in f.read()


def test_names_say_who_owns_them():
    name = shm.new_name("kv", "context_0_0/x")
    assert name.startswith(f"triton_disagg_kv_{shm.me().tag}_context_0_0-x_")
    assert shm.owner_of(name) == shm.me() and shm.me().alive()
    region = shm.new_name("tpb") + "_0b5c3f2e-9d1a-4c1e-8f00-5e2f7a9b1c3d"  # Triton's uuid
    assert shm.owner_of(region) == shm.me() and not shm.orphaned(region)
    for foreign in ("triton_python_backend_shm_region_0b5c", "tdkv_context_0_0_1_ab",
                    "triton_disagg_kv_1-2-3_a/../b", "triton_disagg_kv_1-2_a"):
        assert shm.owner_of(foreign) is None and not shm.orphaned(foreign)
    me = shm.me()
    assert not shm.Owner(me.pidns, me.pid, me.start + 1).alive()   # a reused pid
    assert shm.Owner(me.pidns + 1, 1 << 30, 0).alive()             # another namespace: no say


def test_killed_creators_area_is_swept_by_the_next_create_and_a_live_ones_stays():
    dead, live = Creator(1.0), Creator(2.0)
    try:
        dead.kill()
        assert os.path.exists(dead.path)                # SIGKILL: nobody unlinked it
        area = HostStaging.create("test-shm", num_slots=1, slot_bytes=128)
        area.close()
        assert not os.path.exists(dead.path) and os.path.exists(live.path)
    finally:
        live.kill()
        dead.kill()
    shm.sweep()
    assert not os.path.exists(live.path)


def test_an_area_larger_than_free_shm_is_refused_in_one_line():
    free = os.statvfs(shm.SHM_DIR).f_bavail * os.statvfs(shm.SHM_DIR).f_frsize
    before = set(os.listdir(shm.SHM_DIR))
    with pytest.raises(UserError) as refused:
        HostStaging.create("context_0_0", num_slots=1024, slot_bytes=free // 1024 + 2**20)
    message = str(refused.value)
    assert "\n" not in message and "context_0_0 needs" in message and " free" in message
    assert "kv_cache.max_size" in message and "--shm-size" in message
    assert not {n for n in set(os.listdir(shm.SHM_DIR)) - before if shm.owner_of(n)}


def test_what_live_areas_have_not_filled_yet_counts_as_taken():
    """Areas are sparse; two that each fit the free space but not together are refused,
    or the second would SIGBUS its writer once both fill."""
    st = os.statvfs(shm.SHM_DIR)
    slot_bytes = int(st.f_bavail * st.f_frsize * 0.6) // 64
    first = HostStaging.create("test-shm", num_slots=64, slot_bytes=slot_bytes)
    try:
        with pytest.raises(UserError, match="needs"):
            HostStaging.create("test-shm", num_slots=64, slot_bytes=slot_bytes)
    finally:
        first.close()
    HostStaging.create("test-shm", num_slots=64, slot_bytes=slot_bytes).close()


def test_reader_drops_an_area_whose_creator_died_or_closed_it():
    dst = np.zeros((4, *BLOCK), np.float32)
    reader, dead = StagingReader(), Creator(1.0)
    later = HostStaging.create("test-shm", num_slots=2, slot_bytes=128)
    last = HostStaging.create("test-shm", num_slots=2, slot_bytes=128)
    try:
        reader.fetch(dead.handle, dst, [0])
        assert (dst[0] == 1.0).all() and mapped(dead.handle.shm_name)
        dead.kill()
        reader.fetch(later.put(pool(2.0), [1], 4, "f" * 64, ttl_s=WAIT_S), dst, [1])
        assert (dst[1] == 2.0).all()
        assert not mapped(dead.handle.shm_name) and not os.path.exists(dead.path)
        later.close()                                     # a context stopped cleanly
        assert not os.path.exists(later.path) and mapped(later.name)    # the reader's map
        reader.fetch(last.put(pool(3.0), [1], 4, "f" * 64, ttl_s=WAIT_S), dst, [2])
        assert not mapped(later.name) and mapped(last.name)
        with pytest.raises(StagingError, match="not found: the context server stopped"):
            reader.fetch(dead.handle, dst, [3])
    finally:
        reader.close()
        for area in (later, last):
            area.close()
        dead.kill()
    assert not mapped(last.name)


ECHO = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
            for r in requests]
"""


def start_echo_server(tmp_path):
    """A started (not yet ready) tritonserver serving the ECHO model from ``tmp_path``."""
    from triton_disagg.triton.tritonserver import TritonServer, locate
    from triton_disagg.triton.endpoints import Endpoints

    (tmp_path / "repo" / "echo" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "echo" / "1" / "model.py").write_text(ECHO)
    (tmp_path / "repo" / "echo" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_INT64 dims: [ 1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_INT64 dims: [ 1 ] } ]\n')
    http, grpc = servers.free_ports(2)
    server = TritonServer(locate(), tmp_path / "repo", Endpoints("127.0.0.1", http, grpc, None),
                          tmp_path)
    server.start()
    return server


def test_a_killed_tritonservers_regions_are_gone_after_stop(tmp_path):
    server = start_echo_server(tmp_path)
    try:
        assert server.wait_ready(timeout=120)
        where = server.regions_dir       # its private /dev/shm, where the host allows one
        regions = [n for n in os.listdir(where) if n.startswith(server.shm_prefix)]
        assert regions and all(shm.owner_of(n) == shm.me() for n in regions)
        os.killpg(server.process.pid, signal.SIGKILL)   # tritonserver and its stubs
        server.process.wait(WAIT_S)
        if not server.private_shm:
            assert all(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in regions)
    finally:
        server.stop()
    assert not [n for n in os.listdir(shm.SHM_DIR) if n.startswith(server.shm_prefix)]

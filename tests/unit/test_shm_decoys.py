"""Another user's decoys in ``/dev/shm`` named like the project's entries cannot stop a
``host_memory`` staging area from starting, and are never removed (a sweep touches only
this user's plain files)."""

from __future__ import annotations

import os
import shutil

import pytest

from triton_disagg import shm
from triton_disagg.kv.host_memory import HostStaging

NOBODY = 65534


@pytest.fixture
def decoys():
    """Entries named as the project names them, owned by another user: a huge sparse one of
    a live owner (this process), and a file and a directory of a dead owner."""
    if os.geteuid() != 0:      # never skipped: it fails with what to do, as make test says
        pytest.fail("making another user's file needs root: run the tests as root "
                    "(make test and CI do)")
    me, paths = shm.me(), []
    dead = shm.Owner(me.pidns, me.pid, me.start + 1).tag            # a reused pid: gone
    huge = os.path.join(shm.SHM_DIR, f"{shm.PREFIX}kv_{me.tag}_decoy")
    with open(huge, "wb") as f:
        st = os.statvfs(shm.SHM_DIR)
        f.truncate(2 * st.f_blocks * st.f_frsize)                   # promises all of /dev/shm
    paths.append(huge)
    paths.append(os.path.join(shm.SHM_DIR, f"{shm.PREFIX}kv_{dead}_decoy"))
    open(paths[-1], "wb").close()
    paths.append(os.path.join(shm.SHM_DIR, f"{shm.PREFIX}kv_{dead}_decoydir"))
    os.mkdir(paths[-1])
    for path in paths:
        os.chown(path, NOBODY, NOBODY)
    yield paths
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)


def test_decoys_of_another_user_neither_stop_a_staging_area_nor_are_removed(decoys):
    area = HostStaging.create("decoy-test", num_slots=2, slot_bytes=128)
    try:
        assert all(os.path.exists(path) for path in decoys)
        assert shm.mine(area.path) is not None
        assert [shm.mine(path, os.path.isdir(path)) for path in decoys] == [None] * 3
    finally:
        area.close()


def test_only_this_users_plain_files_named_as_ours_are_mine(tmp_path):
    ours = shm.new_name("kv", "x")
    (tmp_path / ours).write_bytes(b"")
    (tmp_path / "other_software_file").write_bytes(b"")
    os.symlink(tmp_path / ours, tmp_path / shm.new_name("kv", "link"))
    assert shm.mine(str(tmp_path / ours)) is not None
    assert shm.mine(str(tmp_path / ours), directory=True) is None
    assert shm.mine(str(tmp_path / "other_software_file")) is None
    assert [p for p in os.listdir(tmp_path) if shm.mine(str(tmp_path / p))] == [ours]

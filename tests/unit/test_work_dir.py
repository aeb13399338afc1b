"""One ``serve`` per work directory (launch/work_dir.py): a second claim of a claimed
directory refuses in one line naming ``--work-dir`` and the holder; a released one (its
serve exited) can be claimed again; the default names the role, address and gRPC port."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launch.work_dir import claim, default
from triton_disagg.errors import UserError


def test_a_claimed_work_dir_is_refused_until_released(tmp_path):
    first = claim(tmp_path / "w")
    with pytest.raises(UserError) as refused:
        claim(tmp_path / "w")
    (line,) = str(refused.value).splitlines()
    assert "--work-dir" in line and f"pid {os.getpid()}" in line, line
    first.close()
    claim(tmp_path / "w").close()


def test_servers_of_one_role_get_their_own_by_default():
    assert default("context", "127.0.0.1", 9001) != default("context", "127.0.0.1", 9011)
    assert default("context", "127.0.0.2", 9001) != default("context", "127.0.0.3", 9001)
    assert default("all", "127.0.0.1", 8001) == Path("work/all-127.0.0.1-8001")

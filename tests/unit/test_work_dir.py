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


def test_a_work_dir_another_user_can_replace_is_refused(tmp_path):
    """Issue 27 re-review F3: under a directory every user may write (not sticky, as /tmp
    is), another user could swap the rendered model repository for one of theirs, which
    tritonserver would run as this user; serve refuses in one line naming the directory."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UserError) as refused:
        claim(shared / "work" / "all-127.0.0.1-8001")
    (line,) = str(refused.value).splitlines()
    assert str(shared) in line and "--work-dir" in line, line
    assert list(shared.iterdir()) == []           # refused before anything was made there
    shared.chmod(0o1777)                          # sticky, as /tmp: others cannot rename
    claim(shared / "w").close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file of another user")
def test_a_work_dir_or_lock_of_another_user_is_refused(tmp_path):
    planted = tmp_path / "theirs"
    planted.mkdir()
    os.chown(planted, 65534, 65534)
    with pytest.raises(UserError, match="theirs"):
        claim(planted)
    mine = tmp_path / "mine"
    mine.mkdir()
    target = tmp_path / "victim.txt"
    target.write_text("keep me")
    (mine / "serve.lock").symlink_to(target)      # a lock planted as a link is not followed
    with pytest.raises(UserError, match="serve.lock"):
        claim(mine)
    assert target.read_text() == "keep me"

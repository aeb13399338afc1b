"""serve on a host that allows tritonserver no ``/dev/shm`` of its own
(:func:`triton_disagg.triton.private_shm.shared_refusal`): there every local user can read
tritonserver's Python-backend regions (mode 0644), so serve refuses unless the user opts
in. The fallback is simulated (this host may allow the namespace)."""

from __future__ import annotations

import os

import pytest

from triton_disagg import cli
from triton_disagg.triton import private_shm
from triton_disagg.triton.private_shm import (ALLOW_SHARED_ENV, CONTAINER_ONLY, HOST_IPC_NS_INODE,
                                              in_host_ipc_namespace, shared_refusal)


@pytest.mark.parametrize("private, environ, refused", [
    (True, {}, False),                          # a private /dev/shm: nothing to opt in to
    (False, {}, True),
    (False, {ALLOW_SHARED_ENV: "1"}, False),    # the user accepted the shared one
    (False, {ALLOW_SHARED_ENV: "0"}, True),
    (False, {ALLOW_SHARED_ENV: "yes"}, True),   # only "1" opts in
])
def test_the_shared_dev_shm_takes_an_explicit_opt_in(private, environ, refused):
    reason = shared_refusal(private, environ)
    assert (reason is not None) == refused
    if refused:
        assert f"{ALLOW_SHARED_ENV}=1" in reason and "Python-backend regions" in reason
        assert "\n" not in reason


@pytest.mark.parametrize("host_ipc, refused", [
    (False, False),     # docker run's default: the container's own IPC namespace and /dev/shm
    (True, True),       # --ipc=host / hostIPC: true: the host's /dev/shm, every user's
])
def test_the_images_opt_in_holds_only_off_the_hosts_ipc_namespace(host_ipc, refused):
    reason = shared_refusal(False, {ALLOW_SHARED_ENV: CONTAINER_ONLY}, lambda: host_ipc)
    assert (reason is not None) == refused
    if refused:
        assert "--ipc=host" in reason and f"{ALLOW_SHARED_ENV}=1" in reason
        assert "\n" not in reason
    assert shared_refusal(True, {ALLOW_SHARED_ENV: CONTAINER_ONLY}, lambda: True) is None


def test_the_host_ipc_namespace_is_told_by_its_inode(tmp_path):
    """/proc/self/ns/ipc's inode is the kernel's initial IPC namespace's in the host's (and a
    container sharing it); another namespace has another; unreadable counts as the host's."""
    own = in_host_ipc_namespace()
    assert own == (os.stat("/proc/self/ns/ipc").st_ino == HOST_IPC_NS_INODE)
    assert in_host_ipc_namespace(str(tmp_path / "missing")) is True
    assert in_host_ipc_namespace(str(tmp_path)) is False        # any other inode


def test_serve_refuses_the_shared_dev_shm_before_it_starts_anything(demo_engine, tmp_path,
                                                                     monkeypatch, capsys):
    monkeypatch.setattr(private_shm, "possible", lambda: False)
    monkeypatch.delenv(ALLOW_SHARED_ENV, raising=False)
    work_dir = tmp_path / "work"
    code = cli.main(["serve", "all", "--engine", str(demo_engine), "--work-dir", str(work_dir)])
    err = capsys.readouterr().err
    assert code == 2 and f"{ALLOW_SHARED_ENV}=1" in err and "/dev/shm" in err
    assert not work_dir.exists()        # refused before claiming a work dir or a port

"""A ``/dev/shm`` of tritonserver's own, so no other local user reads its Python-backend
regions (prompts, outputs, the peer credential on the way to a stub).

Triton's Python backend creates its regions with boost.interprocess, which sets their
mode to 0644 whatever the umask (seen: umask 077 still gives 0644). So tritonserver starts
in a mount namespace of its own (:func:`enter`, between fork and exec) where ``/dev/shm``
is a fresh tmpfs of mode 0700, the size of the host's; its stubs, which it forks, share
it. The host's ``/dev/shm`` stays reachable inside at ``host_dir`` (a bind mount), where
the project's own entries live (:mod:`triton_disagg.shm` reads ``shm.DIR_ENV``): KV staging
areas that a generation server of another tritonserver maps by name. The tmpfs goes away
with the last process of the namespace, so a killed server leaves no region behind. The
server gets an IPC namespace of its own too, so the SysV segments UCX makes (mode 0660)
are its own and its stubs' alone.

Making the namespace takes ``CAP_SYS_ADMIN`` (root outside a container), or, for another
user, an unprivileged user namespace mapping that user to itself (the server keeps its
uid and gains no capability past exec). :func:`possible` tries the whole sequence once in
a child process; where neither is allowed (Docker's and Kubernetes' default profiles,
whose container already has a ``/dev/shm`` of its own) serve runs tritonserver on the
shared ``/dev/shm`` only when the user opts in (:func:`shared_refusal`): there Triton's
Python-backend regions, which carry every request's tensors, are readable by every local
user (boost.interprocess makes them 0644 whatever the umask). The images opt in only for
a container's own ``/dev/shm`` (``ALLOW_SHARED_ENV=container``): a process in the host's IPC
namespace (``docker run --ipc=host``, Kubernetes ``hostIPC: true``) sees the host's
``/dev/shm``, shared with every user of the host, and is refused
(:func:`in_host_ipc_namespace`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import tempfile
from collections.abc import Callable, Mapping

from triton_disagg.errors import UserError

SHM = b"/dev/shm"
ALLOW_SHARED_ENV = "TRITON_DISAGG_ALLOW_SHARED_SHM"    # "1": serve on the shared /dev/shm
CONTAINER_ONLY = "container"    # ALLOW_SHARED_ENV's value in the images: unless in the host's IPC
# The inode of the kernel's initial IPC namespace (PROC_IPC_INIT_INO, include/linux/proc_ns.h):
# /proc/self/ns/ipc has it in the host's namespace, and in a container that shares it.
HOST_IPC_NS_INODE = 0xEFFFFFFF
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWIPC = 0x00020000, 0x10000000, 0x08000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_SLAVE = 0x2, 0x4, 0x1000, 0x4000, 0x80000

_libc = ctypes.CDLL(None, use_errno=True)     # loaded before any fork: a child only calls it


def enter(host_dir: str) -> None:
    """In a child before exec: a mount namespace whose ``/dev/shm`` is a private tmpfs, the
    host's at ``host_dir`` (an existing directory), and an IPC namespace of its own (UCX's
    SysV segments, mode 0660, are then out of reach of the user's group). OSError when the
    kernel refuses."""
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(CLONE_NEWNS | CLONE_NEWIPC) != 0:
        _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWIPC))
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    st = os.statvfs(SHM)
    _mount(None, b"/", None, MS_REC | MS_SLAVE)         # nothing of ours reaches the host
    _mount(SHM, host_dir.encode(), None, MS_BIND | MS_REC)
    _mount(b"tmpfs", SHM, b"tmpfs", MS_NOSUID | MS_NODEV,
           f"mode=0700,size={st.f_blocks * st.f_frsize}".encode())


@functools.lru_cache(maxsize=1)
def possible() -> bool:
    """Whether :func:`enter` works here (tried once, in a child that exits)."""
    with tempfile.TemporaryDirectory(prefix="triton_disagg_shm_probe_") as scratch:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                enter(scratch)
                code = 0
            finally:
                os._exit(code)
        return os.waitpid(pid, 0)[1] == 0


def in_host_ipc_namespace(ns_path: str = "/proc/self/ns/ipc") -> bool:
    """Whether this process is in the host's initial IPC namespace, where a container's
    ``/dev/shm`` is the host's (Docker and Kubernetes mount it so with the host's IPC); True
    when ``ns_path`` cannot be read (unknown counts as shared)."""
    try:
        return os.stat(ns_path).st_ino == HOST_IPC_NS_INODE
    except OSError:
        return True


def shared_refusal(private: bool, environ: Mapping[str, str],
                   host_ipc: Callable[[], bool] = in_host_ipc_namespace) -> str | None:
    """Why serve must not start tritonserver (one line), or None: it may. It may where the
    server gets a ``/dev/shm`` of its own (``private``, :func:`possible`), where the user
    opted in to the shared one with ``ALLOW_SHARED_ENV=1`` in ``environ``, or, with
    ``ALLOW_SHARED_ENV=container`` (the images'), where ``host_ipc()`` says the ``/dev/shm``
    is not the host's."""
    opted_in = environ.get(ALLOW_SHARED_ENV)
    if private or opted_in == "1":
        return None
    if opted_in == CONTAINER_ONLY:
        if not host_ipc():
            return None
        return (f"{ALLOW_SHARED_ENV}={CONTAINER_ONLY} allows a container's own /dev/shm, but "
                "this process shares the host's IPC namespace (docker run --ipc=host, "
                "Kubernetes hostIPC: true), so /dev/shm is the host's, shared with every local "
                "user, who could read tritonserver's Python-backend regions (prompts and "
                f"outputs); run without the host's IPC, or set {ALLOW_SHARED_ENV}=1 to serve "
                "anyway, accepting that (docs/deploy.md, 'The image')")
    return ("this host allows tritonserver no private /dev/shm (no mount or user namespace), "
            "and on the shared one every local user can read tritonserver's Python-backend "
            f"regions (prompts and outputs); set {ALLOW_SHARED_ENV}=1 to serve anyway, accepting "
            "that (docs/architecture.md, trust boundaries)")


def refuse_shared(environ: Mapping[str, str] = os.environ) -> None:
    """:class:`UserError` with :func:`shared_refusal`'s line where tritonserver must not
    start here: the one check every start goes through (``launch.deploy.start``, which
    serve and the bench call; serve also calls it before it claims a work dir or port)."""
    refusal = shared_refusal(possible(), environ)
    if refusal:
        raise UserError(refusal)


def _mount(source: bytes | None, target: bytes, fstype: bytes | None, flags: int,
           data: bytes | None = None) -> None:
    _check(_libc.mount(source, target, fstype, ctypes.c_ulong(flags), data))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _check(result: int) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))

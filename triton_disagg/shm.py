"""What the project puts in ``/dev/shm``: names that say who owns them, a sweep of what
dead owners left behind, and a free-space check before anything is created.

Every entry is named ``triton_disagg_<kind>_<owner>_<rest>``: ``kind`` is ``kv`` (a KV
staging area, owned by the context model's stub) or ``tpb`` (Triton's Python-backend
regions, owned by the process that started ``tritonserver``); ``owner`` is
``<pid namespace>-<pid>-<start time>``, so a reused pid is not mistaken for the owner.

Invariants: an entry is removed by its owner (close, finalize, SIGTERM), or, once the
owner process is gone (exited, killed, or a zombie), by whoever sweeps: each staging
area's creation, each server start and stop, the test suite's end. An entry whose owner
lives, or lives in another pid namespace (where this process cannot tell), is never
touched. An area is created only when ``/dev/shm`` has room for all of it. Only entries
of this user count (swept, or counted as taken room): a plain file (``/dev/shm``) or
directory (ipc sockets) named as above and owned by this process's user; anything else,
whatever its name (another user's decoy, a link), is left alone and cannot stop a start.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from triton_disagg.errors import UserError

DIR_ENV = "TRITON_DISAGG_HOST_SHM"     # set inside a private /dev/shm (triton.private_shm)
SHM_DIR = os.environ.get(DIR_ENV, "/dev/shm")   # the host's /dev/shm, where entries are shared
PREFIX = "triton_disagg_"
_NAME = re.compile(PREFIX + r"([a-z]+)_(\d+)-(\d+)-(\d+)_[A-Za-z0-9_-]*")


@dataclass(frozen=True)
class Owner:
    pidns: int      # inode of the owner's /proc/<pid>/ns/pid
    pid: int
    start: int      # start time in clock ticks after boot (/proc/<pid>/stat field 22)

    @property
    def tag(self) -> str:
        return f"{self.pidns}-{self.pid}-{self.start}"

    def alive(self) -> bool:
        """True unless the owner is provably gone from this pid namespace."""
        return self.pidns != _pidns() or _start_time(self.pid) == self.start


def me() -> Owner:
    return Owner(_pidns(), os.getpid(), _start_time(os.getpid()))


def new_name(kind: str, label: str = "") -> str:
    """A fresh name owned by this process: ``triton_disagg_<kind>_<owner>_<label>_<random>``."""
    label = re.sub(r"[^A-Za-z0-9_-]", "-", label)
    return f"{PREFIX}{kind}_{me().tag}_{label + '_' if label else ''}{secrets.token_hex(4)}"


def owner_of(name: str) -> Optional[Owner]:
    """The owner named by a project entry's name; None for anything else (other software's
    entries, or a name that is not a plain file name)."""
    match = _NAME.fullmatch(name)
    return Owner(*map(int, match.groups()[1:])) if match else None


def orphaned(name: str) -> bool:
    owner = owner_of(name)
    return owner is not None and not owner.alive()


def mine(path: str, directory: bool = False) -> Optional[os.stat_result]:
    """``path``'s status if it is one of this user's entries: named as a project entry, a
    plain file (``directory``: a directory), not a link, owned by this process's user;
    else None."""
    if owner_of(os.path.basename(path)) is None:
        return None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    kind = stat.S_ISDIR if directory else stat.S_ISREG
    return st if kind(st.st_mode) and st.st_uid == os.geteuid() else None


def sweep() -> None:
    """Unlink every entry of this user's (:func:`mine`) whose owner is gone."""
    for name in os.listdir(SHM_DIR):
        path = os.path.join(SHM_DIR, name)
        if orphaned(name) and mine(path):
            try:
                os.unlink(path)
            except FileNotFoundError:  # another sweeper was first
                pass


def check_free(nbytes: int, what: str) -> None:
    """Raise UserError unless ``/dev/shm`` can still hold ``nbytes`` more.

    Areas are sparse: pages are taken as slots are first written, and a write that finds
    the tmpfs full kills the writer with SIGBUS. So what other live project areas have
    not filled yet counts as taken.
    """
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize - _promised()
    if nbytes > free:
        raise UserError(f"{what} needs {_size(nbytes)} of shared memory but {SHM_DIR} has "
                        f"{_size(max(free, 0))} free; lower kv_cache.max_size, or give "
                        f"{SHM_DIR} more room (Docker: --shm-size)")


def _promised() -> int:
    """Bytes that this user's live entries (:func:`mine`) may still take (their size less
    what they hold)."""
    total = 0
    for name in os.listdir(SHM_DIR):
        st = mine(os.path.join(SHM_DIR, name))
        if st is not None:
            total += max(st.st_size - st.st_blocks * 512, 0)
    return total


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


@lru_cache(maxsize=1)
def _pidns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _start_time(pid: int) -> int:
    """Start time of a live process, or -1 when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return -1
    return -1 if fields[0] == b"Z" else int(fields[19])

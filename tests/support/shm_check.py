"""What a test session left in ``/dev/shm`` (used by conftest's session-finish check).

A project entry (see :mod:`triton_disagg.shm`) made or written since the session started
is this session's leftover when its owner, in this pid namespace, is this process or one
of its descendants (a server or area still alive after the tests), or is gone (nothing
will unlink it until a sweep).
A dead owner's ancestry cannot be told, so a killed server of another session running at
the same time would show up here too; live servers of other sessions never do.
"""

from __future__ import annotations

import os

from triton_disagg import shm


def leftovers(since: float) -> list[str]:
    here, mine = shm.me().pidns, []
    for name in sorted(os.listdir(shm.SHM_DIR)):
        owner = shm.owner_of(name)
        if owner is None or owner.pidns != here:
            continue
        try:
            changed = os.stat(os.path.join(shm.SHM_DIR, name)).st_ctime
        except FileNotFoundError:
            continue
        if changed >= since and (not owner.alive() or _descends_from_me(owner.pid)):
            mine.append(name)
    return mine


def _descends_from_me(pid: int) -> bool:
    while pid > 1:
        if pid == os.getpid():
            return True
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])  # field 4: parent pid
        except (FileNotFoundError, ProcessLookupError):
            return False
    return False

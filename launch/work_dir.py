"""Where ``serve`` writes (the model repository, tritonserver's and the front's logs, the
roles gate): ``--work-dir``, else ``work/<role>-<bind address>-<gRPC port>`` under the
current directory, so two servers of one role on one host (one per GPU, say) started from
one directory each get their own.

Invariant: one ``serve`` at a time uses a work directory. :func:`claim` locks it (an
``flock`` on ``serve.lock`` inside, held while serve runs and released by the kernel when
it exits, however it exits); a second ``serve`` given the same directory refuses in one
line naming ``--work-dir``. Tritonserver runs the model repository rendered there as this
user, so :func:`claim` also refuses a directory that another local user could change
(:func:`replaceable_by_others`): one of its path's directories, or a link on the way,
owned by another user than this one or root, or one that every user may write without
the sticky bit (``/tmp`` is sticky: others cannot rename what is not theirs); and the
lock is never opened through a link.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path
from typing import IO

from triton_disagg.errors import UserError

LOCK = "serve.lock"


def default(role: str, host: str, grpc_port: int) -> Path:
    return Path("work") / f"{role}-{host}-{grpc_port}"


def claim(work_dir: Path) -> IO[str]:
    """Lock ``work_dir`` (created if need be) for this process; keep the returned file open
    while serving. UserError when another live ``serve`` holds it."""
    refuse_replaceable(_nearest_existing(work_dir))     # before creating anything there
    work_dir.mkdir(parents=True, exist_ok=True)
    refuse_replaceable(work_dir)
    try:
        lock = os.fdopen(os.open(work_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_APPEND
                                 | os.O_NOFOLLOW, 0o644), "a+")
    except OSError as exc:              # ELOOP: a link planted in the lock's place
        raise UserError(f"work directory {work_dir}: cannot open {LOCK} ({exc.strerror}); "
                        f"remove it or give serve another --work-dir DIR") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise UserError(f"work directory {work_dir} is in use by another serve (pid {holder}); "
                        f"give this one its own with --work-dir DIR") from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (links not followed)."""
    path = path.absolute()
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def refuse_replaceable(work_dir: Path) -> None:
    """UserError, in one line naming ``--work-dir``, when another local user could change
    ``work_dir`` (an existing directory; :func:`replaceable_by_others`): what tritonserver
    runs from it would not be this user's alone. :func:`claim` and every start of
    tritonserver (``launch.deploy.start``: serve, ``bench serve``, ``bench soak``) check it."""
    unsafe = replaceable_by_others(work_dir)
    if unsafe is not None:
        raise UserError(f"work directory {work_dir}: {unsafe}, so another user could change "
                        f"what tritonserver runs as you; give it one of your own with "
                        f"--work-dir DIR")


def replaceable_by_others(path: Path) -> str | None:
    """Why a local user other than this one (and root) could rename or replace ``path`` or
    an entry in it, else None: a directory of its path, or a link on the way (its own path
    and the one it resolves to, each from the root), owned by another user, or one every
    user may write without the sticky bit. Group write is left to the group's members."""
    me = os.geteuid()
    for one in (path.absolute(), path.resolve()):
        for node in (one, *one.parents):
            st = os.lstat(node)
            if st.st_uid not in (me, 0):
                return f"{node} belongs to user {st.st_uid}"
            if (not stat.S_ISLNK(st.st_mode) and st.st_mode & stat.S_IWOTH
                    and not st.st_mode & stat.S_ISVTX):
                return f"every user may write {node}"
    return None

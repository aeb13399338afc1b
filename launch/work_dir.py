"""Where ``serve`` writes (the model repository, tritonserver's and the front's logs, the
peers gate): ``--work-dir``, else ``work/<role>-<bind address>-<gRPC port>`` under the
current directory, so two servers of one role on one host (one per GPU, say) started from
one directory each get their own.

Invariant: one ``serve`` at a time uses a work directory. :func:`claim` locks it (an
``flock`` on ``serve.lock`` inside, held while serve runs and released by the kernel when
it exits, however it exits); a second ``serve`` given the same directory refuses in one
line naming ``--work-dir``.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from triton_disagg.errors import UserError

LOCK = "serve.lock"


def default(role: str, host: str, grpc_port: int) -> Path:
    return Path("work") / f"{role}-{host}-{grpc_port}"


def claim(work_dir: Path) -> IO[str]:
    """Lock ``work_dir`` (created if need be) for this process; keep the returned file open
    while serving. UserError when another live ``serve`` holds it."""
    work_dir.mkdir(parents=True, exist_ok=True)
    lock = open(work_dir / LOCK, "a+")
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

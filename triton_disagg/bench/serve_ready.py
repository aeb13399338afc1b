"""Waiting for a ``triton-disagg serve`` command a bench started to say it is ready."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from triton_disagg.errors import UserError

READY_LINE = "ready ("          # serve's line once its server answers (a scheduler: and its peers)
TAIL_CHARS = 2000


def wait_ready(proc: subprocess.Popen, log: Path, what: str, timeout: float = 300.0) -> None:
    """Until ``log`` (the command's output) holds :data:`READY_LINE`; a UserError naming
    ``what``, with the log's tail, when the command exits first or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while READY_LINE not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-TAIL_CHARS:]
            raise UserError(f"{what} did not become ready (see {log}):\n{tail}")
        time.sleep(0.2)

"""Stopping a command started as the leader of its own process group
(``start_new_session=True``): a ``serve`` CLI, a tool, a test's server.

Invariant: when :func:`terminate` returns, ``proc`` is reaped; if it outlived its grace,
its whole group was sent SIGKILL first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def terminate(proc: subprocess.Popen, grace: float, whole_group: bool = False) -> bool:
    """SIGTERM ``proc`` (its whole group with ``whole_group``) unless it has ended, wait up
    to ``grace`` s, then SIGKILL its group and reap it. True when it ended within
    ``grace`` (or had already)."""
    if proc.poll() is not None:
        return True
    if whole_group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
        return True
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False

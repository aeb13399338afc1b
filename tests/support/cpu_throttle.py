"""Starve one process of CPU for a while, as a loaded host or a throttled container would:
every thread of it moves into a CPU cgroup allowed ``quota_us`` of CPU per second, then
back to the root cgroup. Needs root and the cgroup v1 ``cpu`` controller
(``/sys/fs/cgroup/cpu``) or cgroup v2 (``cpu.max``); fails with what is missing otherwise."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")


def _cgroup() -> tuple[Path, Path, str]:
    """(the throttling cgroup, the root cgroup, the file tasks are written to)."""
    if (V1 / "cpu.cfs_quota_us").exists():
        return V1 / "triton_disagg_test_throttle", V1, "tasks"
    if (V2 / "cgroup.controllers").exists() and "cpu" in (V2 / "cgroup.controllers").read_text():
        return V2 / "triton_disagg_test_throttle", V2, "cgroup.threads"
    raise AssertionError("no CPU cgroup controller (/sys/fs/cgroup/cpu or cgroup v2 cpu.max): "
                         "this test throttles a stub with one; run it as root on Linux")


def _move(pid: int, cgroup: Path, tasks_file: str) -> None:
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):       # a thread that ended meanwhile
            (cgroup / tasks_file).write_text(task.name)


@contextlib.contextmanager
def throttled(pid: int, quota_us: int = 1000):
    """Within the block, ``pid`` runs at most ``quota_us`` microseconds of CPU a second."""
    if os.geteuid() != 0:
        raise AssertionError("throttling a process with a cgroup needs root")
    cgroup, root, tasks_file = _cgroup()
    cgroup.mkdir(exist_ok=True)
    if tasks_file == "tasks":
        (cgroup / "cpu.cfs_period_us").write_text("1000000")
        (cgroup / "cpu.cfs_quota_us").write_text(str(quota_us))
    else:
        (cgroup / "cgroup.type").write_text("threaded")
        (cgroup / "cpu.max").write_text(f"{quota_us} 1000000")
    _move(pid, cgroup, tasks_file)
    try:
        yield
    finally:
        if Path(f"/proc/{pid}").exists():
            _move(pid, root, tasks_file)

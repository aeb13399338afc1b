"""CPU time of a server's processes, from ``/proc``: tritonserver itself and each
Python-backend stub, named by its model instance.

Triton's per-model compute counters only see ``execute``; the work that models do on
threads of their own (generation's decode loop, the orchestrator's event loop, the
metrics writers) and Triton's own (the ensemble, gRPC) shows only here.

Invariant: a process that ended between two readings is left out of :func:`cpu_delta`.
"""

from __future__ import annotations

import os

from triton_disagg.triton.stub_watch import stubs_of

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (all its threads), or None when it is gone."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS     # utime, stime (fields 14, 15)


def server_cpu(server_pid: int) -> dict[str, float]:
    """``{"tritonserver": s, <model instance>: s, ...}`` as of now."""
    pids = {"tritonserver": server_pid, **{s.instance: s.pid for s in stubs_of(server_pid)}}
    readings = {name: cpu_seconds(pid) for name, pid in pids.items()}
    return {name: s for name, s in readings.items() if s is not None}


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> list[tuple[str, float]]:
    """``(process, CPU seconds between the readings)``, busiest first."""
    rows = [(name, after[name] - before[name]) for name in after if name in before]
    return sorted(rows, key=lambda row: -row[1])

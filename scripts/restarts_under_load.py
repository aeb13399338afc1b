#!/usr/bin/env python3
"""Restart one role's server again and again while the host is loaded (issue 27, item 7):
each start must come up ("ready (") or fail with its cause within ``--bound`` seconds.

    .venv/bin/python scripts/restarts_under_load.py --engine engines/demo \
        [--role all] [--restarts 20] [--load 8] [--bound 120]

``--load N``: N x the usable cores of busy-looping processes (plain CPU spin, nice 0) run
for the whole measurement, as a loaded host runs other work. Each round starts
``triton-disagg serve ROLE --engine ENGINE`` on free loopback ports in a fresh work
directory, waits for its ready line or its exit, records the time and what serve said
(a restart of a start Triton abandoned, :mod:`triton_disagg.triton.stuck_start`,
counts as coming up if it then comes up within the bound), and stops it with SIGTERM.
Prints one line per round and a summary; exits 1 if any round passed the bound or
failed without a cause. Loopback only; bounded in rounds and time.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from triton_disagg.launch.deploy import free_ports
from triton_disagg.launch.process_group import terminate

READY, ERROR = "ready (", "error:"


def _spin() -> None:
    while True:
        pass


def _one_start(role: str, engine: Path, work_dir: Path, bound: float) -> tuple[str, float, str]:
    """(outcome, seconds, serve's output) of one start: outcome "ready", "failed" (serve
    exited with a cause) or "timeout"."""
    http, grpc, metrics, front = free_ports(4)
    cmd = [sys.executable, "-m", "triton_disagg.cli", "serve", role, "--engine", str(engine),
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--front-port", str(front), "--work-dir", str(work_dir)]
    log = work_dir.parent / f"{work_dir.name}.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    outcome = "timeout"
    while time.monotonic() - started < bound:
        text = log.read_text(errors="replace")
        if READY in text:
            outcome = "ready"
            break
        if proc.poll() is not None:
            outcome = "failed"
            break
        time.sleep(0.2)
    took = time.monotonic() - started
    terminate(proc, 60)
    return outcome, took, log.read_text(errors="replace")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True)
    p.add_argument("--role", default="all", choices=("all", "context", "generation"))
    p.add_argument("--restarts", type=int, default=20)
    p.add_argument("--load", type=float, default=8.0, help="busy processes per usable core")
    p.add_argument("--bound", type=float, default=120.0, help="seconds a start may take")
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    spinners = [multiprocessing.Process(target=_spin, daemon=True)
                for _ in range(int(args.load * cores))]
    for s in spinners:
        s.start()
    print(f"{len(spinners)} busy processes on {cores} cores ({args.load:g}x); "
          f"{args.restarts} starts of serve {args.role}, bound {args.bound:.0f} s", flush=True)
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="restarts-") as tmp:
            for i in range(args.restarts):
                outcome, took, output = _one_start(args.role, args.engine,
                                                   Path(tmp) / f"run{i}", args.bound)
                restarted = output.count("restarting tritonserver")
                cause = next((l for l in output.splitlines() if ERROR in l), "")
                results.append((outcome, took, restarted, cause))
                print(f"start {i + 1:2d}: {outcome:7s} after {took:6.1f} s"
                      f"{f', {restarted} restart(s) inside' if restarted else ''}"
                      f"{f' - {cause[:160]}' if cause else ''}", flush=True)
    finally:
        for s in spinners:
            s.kill()
    bad = [r for r in results if r[0] == "timeout" or (r[0] == "failed" and not r[3])]
    times = sorted(r[1] for r in results)
    print(f"{sum(r[0] == 'ready' for r in results)}/{len(results)} ready, "
          f"{sum(r[0] == 'failed' for r in results)} failed with a cause, "
          f"{sum(r[0] == 'timeout' for r in results)} past {args.bound:.0f} s; "
          f"start time median {times[len(times) // 2]:.1f} s, max {times[-1]:.1f} s; "
          f"restarts inside serve: {sum(r[2] for r in results)}")
    return 1 if bad else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())

"""Start one serving configuration of an engine on given cores, for a benchmark.

``disaggregated``: the context model's instance is pinned to the first half of
``cores`` and the generation model's to the second half (both get all of them
when there is one core). ``aggregated``: one generation instance on all of
``cores`` does prefill and decode. Disaggregated, the front end (tritonserver,
preprocessing, orchestrator: ``scheduler_server.cpus``) shares the context's cores, off
generation's, as ``serve all`` places it by default; aggregated, it is not pinned; given
cores of its own (``front``), it runs there in both. The benchmark's client belongs with
it (``Served.front``). So both configurations use the
same cores, and only the split differs.

With ``openai``, the HTTP front (:mod:`triton_disagg.launch.front_process`) runs beside
it, as ``serve all`` runs it (``Served.openai``: its URL).

:func:`serve_cli` runs a ``triton-disagg serve`` command line instead, as a user runs it,
and :func:`wait_ready` waits for such a command to say it is ready.

Invariant: :func:`serving` and :func:`serve_cli` yield a ready server (on free loopback
ports) and stop its whole process group (and the front) on exit, even when the body raises.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from triton_disagg.config.roles import Mode
from triton_disagg.errors import UserError
from triton_disagg.launch.deploy import free_ports
from triton_disagg.launch.process_group import terminate

# serve's line once its server answers (a scheduler: and the roles it routes to)
READY_LINE = "ready ("
TAIL_CHARS = 2000

MODES = tuple(Mode)    # disaggregated, aggregated


@dataclass(frozen=True)
class Served:
    mode: str
    grpc: str                    # host:port
    http: str                    # http://host:port
    metrics: str                 # http://host:port
    log: Path
    pid: int                     # the tritonserver process
    front: tuple[int, ...]       # the front end's cores; () when not pinned
    openai: str | None = None    # http://host:port of the HTTP front, when started
    model: str | None = None     # the model id the HTTP front serves


def placement(mode: str, cores: Sequence[int], stream_interval: int = 1,
              front: Sequence[int] = ()) -> dict:
    """The ``*_server`` part of disagg_config.yaml. ``front``: the front end's cores
    (``scheduler_server.cpus``) in both modes; none given: the context's when
    disaggregated, not pinned when aggregated."""
    cores = list(cores)
    if mode == Mode.AGGREGATED:
        out = {"generation_server": {"cpus": cores, "instances": 1,
                                     "stream_interval": stream_interval}}
    else:
        half = max(1, len(cores) // 2)
        context, generation = cores[:half], cores[half:] or cores[:half]
        out = {"context_server": {"cpus": context}, "scheduler_server": {"cpus": context},
               "generation_server": {"cpus": generation, "stream_interval": stream_interval}}
    if front:
        out["scheduler_server"] = {"cpus": list(front)}
    return out


@contextlib.contextmanager
def serving(mode: str, engine: Path, cores: Sequence[int], work_dir: Path,
            stream_interval: int = 1, ready_timeout: float = 300.0,
            front: Sequence[int] = (), openai: bool = False) -> Iterator[Served]:
    from triton_disagg.config.disagg import parse_config
    from triton_disagg.config.host import check_host
    from triton_disagg.launch.deploy import start
    from triton_disagg.launch.front_process import start_front, stop_front
    from triton_disagg.triton.endpoints import Endpoints

    config = parse_config({"model": {"engine": str(Path(engine).resolve())}, "mode": mode,
                           **placement(mode, cores, stream_interval, front)},
                          source=f"bench serve ({mode})")
    check_host(config)
    http, grpc, metrics, front_port = free_ports(4)
    endpoints = Endpoints("127.0.0.1", http, grpc, metrics)
    server = start("all", config, endpoints, work_dir / mode)
    proc = start_front(config, endpoints, front_port, server.grpc_url, server.work_dir) \
        if openai else None
    try:
        server.wait_ready(ready_timeout)
        yield Served(mode, f"127.0.0.1:{grpc}", f"http://127.0.0.1:{http}",
                     f"http://127.0.0.1:{metrics}", server.log_path, server.process.pid,
                     config.scheduler.cpus,
                     f"http://127.0.0.1:{front_port}" if openai else None,
                     config.served_model_name)
    finally:
        if proc is not None:
            stop_front(proc)
        server.stop()


def wait_ready(proc: subprocess.Popen, log: Path, what: str, timeout: float = 300.0,
               marker: str = READY_LINE) -> float:
    """Until ``log`` (the command's output) holds ``marker``: the seconds it took; a
    UserError naming ``what``, with the log's tail, when the command exits first or
    ``timeout`` s pass."""
    start = time.monotonic()
    while marker not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() - start > timeout:
            tail = log.read_text(errors="replace")[-TAIL_CHARS:]
            raise UserError(f"{what} did not become ready (see {log}):\n{tail}")
        time.sleep(0.2)
    return time.monotonic() - start


@contextlib.contextmanager
def serve_cli(args: list[str], cli_log: Path, ready_timeout: float = 300.0,
              marker: str = READY_LINE) -> Iterator[tuple[subprocess.Popen, float]]:
    """Run ``triton-disagg serve *args`` (its output to ``cli_log``) until the block exits;
    yields (the process, seconds until its output showed ``marker``)."""
    with open(cli_log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "triton_disagg.cli", "serve", *args],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc, wait_ready(proc, cli_log, f"serve {args[0]}", ready_timeout, marker)
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM ``serve`` (it stops tritonserver and the stubs), SIGKILL the group if slow."""
    terminate(proc, timeout)
    with contextlib.suppress(ProcessLookupError):   # what the group left behind
        os.killpg(proc.pid, signal.SIGKILL)

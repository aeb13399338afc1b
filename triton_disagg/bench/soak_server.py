"""`serve all` for the soak, run as a user runs it: a ``triton-disagg serve all -c`` process.

The soak watches the server only from outside (its endpoints, its log, the process
table), so it starts the real CLI, whose stub watch restarts tritonserver when a stub
dies; the soak reads that from the CLI's output and counts it as a crash.

Afterwards :func:`scan_logs` counts crash lines in tritonserver's logs (the live one
and any a restart kept) and ``serve``'s output, and :func:`wait_pools_empty` reads
``disagg_kv_blocks_used`` per instance from ``/metrics``.

Invariant: :func:`serving` yields once ``serve`` printed its ready line, and on exit the
whole process group (``serve``, tritonserver, the stubs) is gone.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from triton_disagg.bench.serve_servers import serve_cli
from triton_disagg.triton import server_log
from triton_disagg.triton.server_log import is_cpu_noise

CRASH_MARKERS = ("Fatal Python error", "Segmentation fault")
STUB_DEATH = "the stub process of"
_ERROR_ID = re.compile(r"0x[0-9a-f]+|\d+")     # addresses and numbers vary between lines


@dataclass(frozen=True)
class SoakServer:
    process: subprocess.Popen
    http: str                    # http://127.0.0.1:PORT
    grpc: str                    # 127.0.0.1:PORT
    metrics: str                 # http://127.0.0.1:PORT
    work_dir: Path               # serve's --work-dir: tritonserver*.log live here
    cli_log: Path                # serve's own output
    ready_seconds: float

    def server_logs(self) -> list[Path]:
        return sorted(self.work_dir.glob("tritonserver*.log"))


def config_for(engine: Path, strategy: str, instances: int, cores: Sequence[int],
               overlap: bool = False) -> tuple[dict, str]:
    """disagg_config.yaml for one strategy (with ``overlap``: ``kv_cache.overlap_transfer``
    on, the guide's ``--overlap_kv_transfer``), and its placement in words. With a core for
    the context and one per generation instance, each is pinned; otherwise nothing is (on a
    2-core host two generation instances and a context instance share the cores)."""
    cores = list(cores)
    if len(cores) >= 1 + instances:
        context, generation = {"cpus": cores[:1]}, {"cpus": cores[1:], "instances": instances}
        words = f"context on core {cores[0]}, generation on cores {cores[1:]}"
    else:
        context, generation = {"instances": 1}, {"instances": instances}
        words = f"unpinned on {len(cores)} cores"
    return ({"model": {"engine": str(engine)}, "mode": "disaggregated",
             "context_server": context, "generation_server": generation,
             "kv_cache": {"strategy": strategy, "max_size": "256MB",
                          **({"overlap_transfer": True} if overlap else {})}},
            f"{instances} generation instances, {words}")


@contextlib.contextmanager
def serving(config: dict, work_dir: Path, ready_timeout: float = 300.0) -> Iterator[SoakServer]:
    import yaml

    from triton_disagg.launch.deploy import free_ports

    work_dir = work_dir.resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "disagg_config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    http, grpc, metrics = free_ports(3)
    server_dir, cli_log = work_dir / "server", work_dir / "serve.log"
    args = ["all", "-c", str(config_path), "--http-port", str(http), "--grpc-port", str(grpc),
            "--metrics-port", str(metrics), "--work-dir", str(server_dir)]
    with serve_cli(args, cli_log, ready_timeout) as (proc, ready_seconds):
        yield SoakServer(proc, f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}",
                         f"http://127.0.0.1:{metrics}", server_dir, cli_log, ready_seconds)


# --- afterwards: logs and pools ---------------------------------------------------------

@dataclass
class Crashes:
    fatal: int = 0                # "Fatal Python error" lines
    segfault: int = 0             # "Segmentation fault" lines
    stub_deaths: int = 0          # serve saw a stub die and restarted tritonserver
    server_exits: int = 0         # serve saw tritonserver exit, or serve itself exited early
    evidence: list[str] = field(default_factory=list)
    error_lines: Counter = field(default_factory=Counter)   # Triton's E lines, by message

    @property
    def total(self) -> int:
        return self.fatal + self.segfault + self.stub_deaths + self.server_exits


def scan_logs(server_logs: list[Path], serve_log: Path | None) -> Crashes:
    """Crash lines in tritonserver's logs (the live one and any a restart kept) and in
    ``serve``'s output."""
    crashes, seen = Crashes(), Counter()
    for path in server_logs:
        for line in _lines(path):
            # Triton's error lines: E1203 12:33:19.940615 18147 pb_stub.cc:930] "message"
            if server_log.level(line) == "E" and "] " in line and not is_cpu_noise(line):
                crashes.error_lines[_ERROR_ID.sub("#", line.split("] ", 1)[1])[:120]] += 1
            for marker, attr in zip(CRASH_MARKERS, ("fatal", "segfault")):
                if marker in line:
                    setattr(crashes, attr, getattr(crashes, attr) + 1)
                    seen[f"{path.name}: {line.strip()[:160]}"] += 1
    for line in _lines(serve_log) if serve_log else []:
        if STUB_DEATH in line and "died" in line:
            crashes.stub_deaths += 1
            seen[f"serve: {line.strip()[:160]}"] += 1
        elif line.startswith("tritonserver exited with code"):
            crashes.server_exits += 1
            seen[f"serve: {line.strip()[:160]}"] += 1
    crashes.evidence = [f"{text} (x{n})" if n > 1 else text for text, n in seen.most_common(5)]
    return crashes


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def pool_blocks(metrics_url: str) -> dict[str, float]:
    """``{model instance: disagg_kv_blocks_used}`` from the metrics endpoint."""
    from triton_disagg.routing.scrape import by_label, scrape
    from triton_disagg.triton.metrics import MODEL_INSTANCE

    return by_label(scrape(metrics_url), "disagg_kv_blocks_used", MODEL_INSTANCE)


def wait_pools_empty(metrics_url: str, timeout: float) -> tuple[dict[str, float], float]:
    """Poll until every pool reports 0 blocks used or ``timeout`` passes:
    (the last reading, seconds waited)."""
    start = time.monotonic()
    while True:
        try:
            blocks = pool_blocks(metrics_url)
        except OSError:
            blocks = {}
        waited = time.monotonic() - start
        if (blocks and not any(blocks.values())) or waited > timeout:
            return blocks, waited
        time.sleep(1.0)

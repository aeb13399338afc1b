"""The soak's outside load generators: genai-perf in time-window mode, and locust.

genai-perf (NVIDIA's, as TensorRT-LLM users run it against their ensemble) lives in a
venv of its own (``scripts/install-genai-perf.sh``); :func:`find_genai_perf` refuses
to go on without it. :func:`genai_perf_loop` runs it back to back until the soak's
end; each run's ``profile_export.json`` lists its requests with their response times.
locust runs ``clients/locustfile.py`` headless with both users (gRPC streaming and
HTTP server-sent events) and writes its stats as CSV.

Invariant: each tool's requests become a :class:`Tally` like the soak's own clients'
(see :mod:`.soak_watch`): a request whose last response came after its deadline is
hung; a tool run that had to be killed is one hung request; a run that failed is one
unexpected error when its own output cannot say how many requests failed.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from triton_disagg.bench.soak_watch import Tally, deadline_seconds
from triton_disagg.errors import UserError

DEFAULT_VENV = Path("/tmp/genai-perf-venv")
INSTALL_HINT = "scripts/install-genai-perf.sh"
GENAI_PERF_OUTPUT_TOKENS = 24
GENAI_PERF_CONCURRENCY = 4
GENAI_PERF_RUN_TIMEOUT = 300.0      # a run measures 3 x 8 s windows plus start-up
MIN_RUN_SECONDS = 30.0              # start another run only with this much time left
LOCUST_OUTPUT_TOKENS = "uniform:16,64"
LOCUST_MAX_OUTPUT = 64
LOCUST_STOP_TIMEOUT = 60


@dataclass(frozen=True)
class GenaiPerf:
    exe: Path
    env: dict[str, str]


def find_genai_perf(path: Path | None) -> GenaiPerf:
    """The genai-perf executable (``path``: it, or its venv; default the installer's venv),
    with the PATH and LD_LIBRARY_PATH its perf_analyzer needs. A :class:`UserError` naming
    the install script when it is not there."""
    given = Path(path) if path else DEFAULT_VENV
    exe = given / "bin" / "genai-perf" if given.is_dir() else given
    python, analyzer = exe.parent / "python", exe.parent / "perf_analyzer"
    if not (exe.is_file() and analyzer.is_file() and python.is_file()):
        raise UserError(f"genai-perf not found at {given}; install it with {INSTALL_HINT} "
                        f"[VENV] (default {DEFAULT_VENV}) or pass --genai-perf PATH")
    found = subprocess.run(
        [str(python), "-c", "import nvidia.cuda_runtime as m, os; "
                            "print(os.path.join(m.__path__[0], 'lib'))"],
        capture_output=True, text=True)
    if found.returncode != 0:
        raise UserError(f"{exe}: its venv lacks nvidia-cuda-runtime-cu12 (perf_analyzer needs "
                        f"libcudart); rerun {INSTALL_HINT} {exe.parent.parent}")
    env = dict(os.environ, PATH=f"{exe.parent}{os.pathsep}{os.environ.get('PATH', '')}",
               LD_LIBRARY_PATH=found.stdout.strip())
    return GenaiPerf(exe, env)


def genai_perf_command(gp: GenaiPerf, grpc: str, tokenizer: Path, artifacts: Path) -> list[str]:
    """The issue's time-window command (3 windows of 8 s: stability 999 % accepts any)."""
    return [str(gp.exe), "profile", "-m", "ensemble", "--endpoint-type", "kserve",
            "--backend", "tensorrtllm", "--streaming", "-u", grpc, "--tokenizer", str(tokenizer),
            "--synthetic-input-tokens-mean", "64",
            "--output-tokens-mean", str(GENAI_PERF_OUTPUT_TOKENS),
            "--concurrency", str(GENAI_PERF_CONCURRENCY), "--measurement-interval", "8000",
            "--stability-percentage", "999", "--artifact-dir", str(artifacts)]


def read_profile_export(path: Path, tally: Tally, max_tokens: int) -> None:
    """Add one genai-perf run's requests (perf_analyzer's profile_export.json) to ``tally``."""
    limit = deadline_seconds(max_tokens) * 1e9
    for experiment in json.loads(path.read_text()).get("experiments", []):
        for request in experiment.get("requests", []):
            tally.sent += 1
            stamps = request.get("response_timestamps") or []
            if not stamps:
                tally.unexpected_error += 1
            elif int(stamps[-1]) - int(request["timestamp"]) > limit:
                tally.hung += 1
            else:
                tally.ok += 1


def _stop_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def genai_perf_loop(gp: GenaiPerf, grpc: str, tokenizer: Path, stop_at: float, out_dir: Path,
                    tally: Tally, say=print) -> None:
    """Run genai-perf back to back until ``stop_at`` (``time.monotonic``); fill ``tally``."""
    for n in range(1, 1 << 20):
        left = stop_at - time.monotonic()
        if left <= 0 or (n > 1 and left < MIN_RUN_SECONDS):
            return
        artifacts = out_dir / f"run-{n}"
        artifacts.mkdir(parents=True, exist_ok=True)
        with open(artifacts / "genai-perf.log", "wb") as log:
            proc = subprocess.Popen(genai_perf_command(gp, grpc, tokenizer, artifacts), env=gp.env,
                                    stdout=log, stderr=subprocess.STDOUT, cwd=artifacts,
                                    start_new_session=True)
        try:
            rc = proc.wait(timeout=GENAI_PERF_RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            tally.sent += 1
            tally.hung += 1
            tally.examples.append(f"run {n} still running after {GENAI_PERF_RUN_TIMEOUT:.0f} s "
                                  f"(killed; log {artifacts / 'genai-perf.log'})")
            continue
        exports = sorted(artifacts.glob("**/profile_export.json"))
        before = tally.sent
        for export in exports:
            read_profile_export(export, tally, GENAI_PERF_OUTPUT_TOKENS)
        say(f"genai-perf run {n}: exit {rc}, {tally.sent - before} requests measured")
        if rc != 0:
            tally.sent += 1
            tally.unexpected_error += 1
            why = _last_error(artifacts / "genai-perf.log")
            tally.examples.append(f"run {n} exited {rc}: {why}")


def _last_error(log: Path) -> str:
    lines = [l.strip() for l in log.read_text(errors="replace").splitlines() if l.strip()]
    errors = [l for l in lines if "error" in l.lower()]
    return ((errors or lines or ["(no output)"])[-1])[:200]


# --- locust -------------------------------------------------------------------------

def start_locust(http: str, grpc: str, tokenizer: Path, seconds: float, users: int,
                 out_dir: Path) -> subprocess.Popen:
    import triton_disagg.clients as clients

    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TD_GRPC_URL=grpc, TD_TOKENIZER=str(tokenizer), TD_SEED="0",
               TD_PROMPT_TOKENS="uniform:16,64", TD_OUTPUT_TOKENS=LOCUST_OUTPUT_TOKENS)
    locustfile = Path(clients.__file__).parent / "locustfile.py"
    cmd = [sys.executable, "-m", "locust", "-f", str(locustfile),
           "--headless", "-u", str(users), "-r", str(users), "-t", f"{max(1, round(seconds))}s",
           "--stop-timeout", str(LOCUST_STOP_TIMEOUT), "--host", http, "--csv", "run",
           "--only-summary"]
    with open(out_dir / "locust.log", "wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out_dir,
                                start_new_session=True)


def locust_tallies(proc: subprocess.Popen, out_dir: Path, wait: float) -> dict[str, Tally]:
    """Wait up to ``wait`` s for locust to end, then one :class:`Tally` per user type from
    its e2e entries (a run killed for running over counts one hung request)."""
    try:
        proc.wait(timeout=wait)
        killed = False
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        killed = True
    out: dict[str, Tally] = {}
    stats, failures = out_dir / "run_stats.csv", out_dir / "run_failures.csv"
    rows = list(csv.DictReader(open(stats, newline=""))) if stats.is_file() else []
    limit_ms = deadline_seconds(LOCUST_MAX_OUTPUT) * 1e3
    for row in rows:
        if row["Name"] != "e2e":
            continue
        t = out.setdefault(f"locust {row['Type']}", Tally())
        t.sent, failed = int(row["Request Count"]), int(row["Failure Count"])
        t.unexpected_error = failed
        if float(row["Max Response Time"] or 0) > limit_ms:
            t.hung = 1                      # at least one; the CSV has no per-request times
            t.examples.append(f"slowest e2e {float(row['Max Response Time']) / 1e3:.1f} s > "
                              f"{limit_ms / 1e3:.0f} s")
        t.ok = t.sent - failed - t.hung
    for row in csv.DictReader(open(failures, newline="")) if failures.is_file() else []:
        t = out.setdefault(f"locust {row['Method']}", Tally())
        if len(t.examples) < 3:
            t.examples.append(f"{row['Occurrences']}x {row['Error'][:160]}")
    if killed or not rows:
        t = out.setdefault("locust", Tally())
        t.sent += 1
        t.hung += killed
        t.unexpected_error += not killed
        t.examples.append("killed: still running past its stop timeout" if killed else
                          f"wrote no stats (exit {proc.returncode}; see {out_dir / 'locust.log'})")
    return out

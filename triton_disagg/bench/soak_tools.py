"""The soak's outside load generators: genai-perf in time-window mode, and locust.

genai-perf (NVIDIA's, as TensorRT-LLM users run it against their ensemble) lives in a
venv of its own (``scripts/install-genai-perf.sh``); :func:`find_genai_perf` refuses
to go on without it. :func:`genai_perf_loop` runs it back to back until the soak's
end; each run's ``profile_export.json`` lists its requests with their response times.
locust runs ``clients/locustfile.py`` headless with both users (gRPC streaming and
HTTP server-sent events) and writes its stats as CSV.

Invariant: each tool's requests become a :class:`Tally` like the soak's own clients'
(see :mod:`.soak_watch`): a request whose last response came after its deadline is
hung; a tool run that had to be killed is one hung request; a run that failed (a
non-zero exit, or a profile export missing, unreadable or listing no request) is one
unexpected error, with the tail of the tool's log, but for one fault of the tool's own:
perf_analyzer sometimes measures and then writes a 0-byte export (two CI runs so far; it
exits 0, and genai-perf then fails to parse it), and such a run is run again once, even
past the soak's end, instead of counted (:data:`TOOL_FAULT_RETRIES`; the next one
counts, whatever it is). The soak waits for a genai-perf run in flight, so no run is cut
short by the soak's end; a loop none of whose runs measured a request raises
:class:`NoRequestsMeasured` (its thread then fails the soak).
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
TOOL_FAULT_RETRIES = 1              # runs again after perf_analyzer wrote an empty export
LOG_TAIL_LINES = 4                  # of a failed run's log, in its failure's example
LOG_TAIL_CHARS = 400
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
               LD_LIBRARY_PATH=found.stdout.strip(),
               COLUMNS="200")             # its log's lines unwrapped (rich wraps at 80)
    return GenaiPerf(exe, env)


def genai_perf_command(gp: GenaiPerf, grpc: str, tokenizer: Path, artifacts: Path) -> list[str]:
    """The issue's time-window command (3 windows of 8 s: stability 999 % accepts any);
    verbose, so that perf_analyzer's own output (why it failed) is in the run's log."""
    return [str(gp.exe), "profile", "-v", "-m", "ensemble", "--endpoint-type", "kserve",
            "--backend", "tensorrtllm", "--streaming", "-u", grpc, "--tokenizer", str(tokenizer),
            "--synthetic-input-tokens-mean", "64",
            "--output-tokens-mean", str(GENAI_PERF_OUTPUT_TOKENS),
            "--concurrency", str(GENAI_PERF_CONCURRENCY), "--measurement-interval", "8000",
            "--stability-percentage", "999", "--artifact-dir", str(artifacts)]


class NoRequestsMeasured(RuntimeError):
    """A genai-perf loop ended without one run that measured a request."""


def read_profile_export(path: Path, tally: Tally, max_tokens: int) -> int:
    """Add one genai-perf run's requests (perf_analyzer's profile_export.json) to ``tally``;
    how many. ValueError when the file is not such an export (empty, not JSON, a field
    missing or of the wrong type); then ``tally`` is unchanged."""
    limit = deadline_seconds(max_tokens) * 1e9
    outcomes = []
    try:
        for experiment in json.loads(path.read_text()).get("experiments", []):
            for request in experiment.get("requests", []):
                stamps = request.get("response_timestamps") or []
                if not stamps:
                    outcomes.append("unexpected_error")
                elif int(stamps[-1]) - int(request["timestamp"]) > limit:
                    outcomes.append("hung")
                else:
                    outcomes.append("ok")
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"not a profile export: {type(e).__name__}: {e}") from e
    tally.sent += len(outcomes)
    for outcome in outcomes:
        setattr(tally, outcome, getattr(tally, outcome) + 1)
    return len(outcomes)


def judge_genai_perf_run(n: int, rc: int, artifacts: Path, tally: Tally) -> int:
    """Count run ``n``'s requests (its exit code ``rc``, its ``artifacts`` folder) into
    ``tally``; how many it measured. A run that exited non-zero, or left no profile
    export, or one that cannot be read or that lists no request, is one unexpected error
    whose example names the run, what went wrong and the tail of its log."""
    exports = sorted(artifacts.glob("**/profile_export.json"))
    problems = [] if rc == 0 else [f"exited {rc}"]
    measured = 0
    for export in exports:
        try:
            measured += read_profile_export(export, tally, GENAI_PERF_OUTPUT_TOKENS)
        except (OSError, ValueError) as e:                  # JSONDecodeError is one
            problems.append(f"{export.name} unreadable ({type(e).__name__}: {e})")
    if not exports:
        problems.append("wrote no profile_export.json")
    elif not measured and not problems:
        problems.append("its profile export lists no request")
    if problems:
        log = artifacts / "genai-perf.log"
        tally.sent += 1
        tally.unexpected_error += 1
        tally.examples.append(f"run {n} {'; '.join(problems)}; {log} ends: {log_tail(log)}")
    return measured


def log_tail(log: Path) -> str:
    """The last ``LOG_TAIL_LINES`` non-blank lines of ``log``, spaces squeezed, on one line
    of at most ``LOG_TAIL_CHARS``."""
    try:
        text = log.read_text(errors="replace")
    except OSError as e:
        return f"(unreadable: {e})"
    lines = [" ".join(line.split()) for line in text.splitlines() if line.strip()]
    tail = " | ".join(lines[-LOG_TAIL_LINES:]) or "(empty)"
    return tail if len(tail) <= LOG_TAIL_CHARS else "..." + tail[-LOG_TAIL_CHARS:]


def _stop_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_genai_perf(gp: GenaiPerf, grpc: str, tokenizer: Path, artifacts: Path) -> int | None:
    """One genai-perf run writing into ``artifacts`` (its output in ``genai-perf.log``);
    its exit code, or None when it ran past ``GENAI_PERF_RUN_TIMEOUT`` and was killed."""
    artifacts.mkdir(parents=True, exist_ok=True)
    with open(artifacts / "genai-perf.log", "wb") as log:
        proc = subprocess.Popen(genai_perf_command(gp, grpc, tokenizer, artifacts), env=gp.env,
                                stdout=log, stderr=subprocess.STDOUT, cwd=artifacts,
                                start_new_session=True)
    try:
        return proc.wait(timeout=GENAI_PERF_RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        return None


def wrote_empty_exports(rc: int, artifacts: Path) -> bool:
    """Did a failed run fail only because perf_analyzer wrote its profile export(s) empty
    (0 bytes; the module docstring)?"""
    exports = list(artifacts.glob("**/profile_export.json"))
    return rc != 0 and bool(exports) and all(e.stat().st_size == 0 for e in exports)


def genai_perf_loop(gp: GenaiPerf, grpc: str, tokenizer: Path, stop_at: float, out_dir: Path,
                    tally: Tally, say=print) -> None:
    """Run genai-perf back to back until ``stop_at`` (``time.monotonic``), and once more
    after a run perf_analyzer left an empty export (not counted, at most
    ``TOOL_FAULT_RETRIES`` times); fill ``tally``. :class:`NoRequestsMeasured` when no run
    measured a request."""
    runs = measured = retried = 0
    again = False
    while True:
        left = stop_at - time.monotonic()
        if not again and (left <= 0 or (runs and left < MIN_RUN_SECONDS)):
            break
        again = False
        runs += 1
        artifacts = out_dir / f"run-{runs}"
        rc = run_genai_perf(gp, grpc, tokenizer, artifacts)
        if rc is None:
            tally.sent += 1
            tally.hung += 1
            tally.examples.append(f"run {runs} still running after {GENAI_PERF_RUN_TIMEOUT:.0f}"
                                  f" s (killed; log {artifacts / 'genai-perf.log'})")
            continue
        if retried < TOOL_FAULT_RETRIES and wrote_empty_exports(rc, artifacts):
            retried += 1
            again = True
            say(f"genai-perf run {runs}: exit {rc}, perf_analyzer wrote an empty profile export "
                f"(a fault of the tool's own); not counted, running again")
            continue
        got = judge_genai_perf_run(runs, rc, artifacts, tally)
        measured += got
        say(f"genai-perf run {runs}: exit {rc}, {got} requests measured")
    if not measured:
        raise NoRequestsMeasured(f"no genai-perf run measured a request (runs: {runs})")


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
    its e2e entries (a run killed for running over counts one hung request; one that
    measured no e2e request, one unexpected error)."""
    try:
        proc.wait(timeout=wait)
        killed = False
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        killed = True
    out: dict[str, Tally] = {}
    stats, failures = out_dir / "run_stats.csv", out_dir / "run_failures.csv"
    rows = list(csv.DictReader(open(stats, newline=""))) if stats.is_file() else []
    e2e = [row for row in rows if row["Name"] == "e2e"]
    limit_ms = deadline_seconds(LOCUST_MAX_OUTPUT) * 1e3
    for row in e2e:
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
    if killed or not sum(int(row["Request Count"]) for row in e2e):
        t = out.setdefault("locust", Tally())
        t.sent += 1
        t.hung += killed
        t.unexpected_error += not killed
        log = out_dir / "locust.log"
        t.examples.append("killed: still running past its stop timeout" if killed else
                          f"measured no e2e request (exit {proc.returncode}; {log} ends: "
                          f"{log_tail(log)})")
    return out

"""Readiness as a load balancer or Kubernetes probe sees it: ``/v2/health/ready`` is false
until every model has loaded, and stays false when a model fails to load."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import servers
from triton_disagg.clients.health import ServerNotReady, probe, require_ready
from triton_disagg.launch.process_group import terminate

TIMEOUT = 240.0
SERVE_ALL = [sys.executable, "-m", "triton_disagg.cli", "serve", "all"]


def _corrupt_copy(engine: Path, dest: Path) -> Path:
    shutil.copytree(engine, dest)
    (dest / "weights.safetensors").write_bytes(b"\x00not safetensors" * 64)
    return dest


def _watch(cmd: list[str], http: str, log: Path, until: str) -> tuple[list[bool], subprocess.Popen]:
    """Start ``cmd``; probe ready every 0.2 s until ``until`` is in its output or it exits."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    seen, deadline = [], time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None and until not in log.read_text():
        seen.append(probe(http, "http", timeout=1.0)[1])
        time.sleep(0.2)
    return seen, proc


def test_ready_is_false_while_models_load(demo_engine, tmp_path):
    http, grpc, metrics = servers.free_ports(3)
    cmd = [*SERVE_ALL, "--engine", str(demo_engine),
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--work-dir", str(tmp_path)]
    url = f"http://127.0.0.1:{http}"
    seen, proc = _watch(cmd, url, tmp_path / "cli.log", "ready (")
    try:
        assert proc.poll() is None, (tmp_path / "cli.log").read_text()
        assert seen and not seen[0], "ready before the models were loaded"
        assert probe(url, "http") == (True, True, True)
        require_ready(url, "http")
        require_ready(f"127.0.0.1:{grpc}", "grpc")
    finally:
        terminate(proc, 60, whole_group=True)


def test_serve_with_a_corrupt_engine_never_reports_ready(demo_engine, tmp_path):
    engine = _corrupt_copy(demo_engine, tmp_path / "engine")
    http, grpc = servers.free_ports(2)
    cmd = [*SERVE_ALL, "--engine", str(engine),
           "--http-port", str(http), "--grpc-port", str(grpc), "--work-dir", str(tmp_path / "w")]
    started = time.monotonic()
    seen, proc = _watch(cmd, f"http://127.0.0.1:{http}", tmp_path / "cli.log", "ready (")
    try:
        assert proc.wait(timeout=60) != 0
        assert time.monotonic() - started < 15.0
    finally:
        terminate(proc, 60, whole_group=True)
    assert not any(seen)
    text = (tmp_path / "cli.log").read_text()
    error = next(line for line in text.splitlines() if "error:" in line)
    # the cause first, in one line: the model and the exception its initialize raised
    assert "failed to load: EngineFormatError:" in error and "weights.safetensors" in error, text
    assert "CUDA driver" not in text and "NVML" not in text     # CPU-host noise filtered
    assert "Fatal Python error" not in (tmp_path / "w" / "tritonserver.log").read_text()


def test_live_but_not_ready_when_a_model_fails_to_load(demo_engine, tmp_path):
    """A server kept up despite the failure (--exit-on-error=false): live, never ready, while
    the ensemble's own flag says ready (the models it reaches by BLS are not its steps)."""
    from triton_disagg.config.disagg import default_config
    from triton_disagg.triton.render import render
    from triton_disagg.triton.tritonserver import TritonServer, locate
    from triton_disagg.triton.endpoints import Endpoints

    class KeepGoing(TritonServer):
        def command(self, backends):
            return super().command(backends) + ["--exit-on-error=false"]

    engine = _corrupt_copy(demo_engine, tmp_path / "engine")
    http, grpc = servers.free_ports(2)
    repo = render("all", default_config(engine), tmp_path / "repo")
    server = KeepGoing(locate(), repo, Endpoints("127.0.0.1", http, grpc, None), tmp_path)
    server.start()
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + TIMEOUT
        while not probe(url, "http", "generation")[0]:
            assert server.process.poll() is None and time.monotonic() < deadline, server.log_tail()
            time.sleep(0.3)
        live, ready, ensemble_ready = probe(url, "http")
        assert live and not ready
        assert probe(url, "http", "generation")[2] is False
        # The ensemble itself loaded (its steps did): only the server-wide flag tells.
        assert ensemble_ready
        for target, protocol in ((url, "http"), (f"127.0.0.1:{grpc}", "grpc")):
            with pytest.raises(ServerNotReady, match="not ready"):
                require_ready(target, protocol)
    finally:
        server.stop()

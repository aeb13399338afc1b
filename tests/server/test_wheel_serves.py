"""A wheel installed anywhere serves: ``pip wheel`` of this checkout, installed into a fresh
venv, runs ``triton-disagg serve all`` from a folder outside the checkout to ready and
answers a request with the offline engine's text; ``launch k8s`` from there renders the
Grafana dashboard's ConfigMap. Both read package data (the model repository templates,
the dashboard) that an editable install finds in the checkout and a wheel must carry.

The fresh venv gets no download: it is made from the base interpreter of the test venv,
and a ``.pth`` file appends the test venv's site-packages (as plain folders: their
``.pth`` files, among them the editable install's finder of this checkout, are not
run), so the dependencies are the installed ones and ``triton_disagg`` is the wheel's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import servers
from triton_disagg.launch.deploy import free_ports

ROOT = Path(__file__).resolve().parents[2]
# The first test also builds the wheel and installs it into a fresh venv (limits of 300,
# 120 and 300 s) before it serves: more than pyproject's 900 s may pass under CI load.
pytestmark = pytest.mark.timeout(1500)
PROMPT, MAX_TOKENS = "The quick brown fox", 16
SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                              "engines", "checkpoints", "work")


def _source_copy(dest: Path) -> Path:
    """The checkout's files (git's tracked and untracked-not-ignored when it is a git
    checkout) copied to ``dest``, so the build writes nothing into the checkout."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
                            capture_output=True) if (ROOT / ".git").exists() else None
    if listed is None or listed.returncode != 0:
        shutil.copytree(ROOT, dest, ignore=SKIP)
        return dest
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def _run(argv: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{argv}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _clean_env(venv: Path) -> dict[str, str]:
    """Our environment without anything that would point Python at the checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    return env


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A fresh venv with the wheel of this checkout installed (no dependencies of its own)."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", _source_copy(tmp / "src"), "-w", dist], timeout=300)
    (wheel,) = dist.glob("triton_disagg-*.whl")

    venv = tmp / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", "--without-pip", venv], timeout=120)
    site = Path(_run([venv / "bin" / "python", "-c",
                      "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "test-venv-dependencies.pth").write_text("".join(f"{d}\n" for d in ours))
    # pip comes from the test venv's site-packages; --ignore-installed: the checkout's
    # editable triton-disagg it sees there is neither used nor uninstalled.
    _run([venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index",
          "--ignore-installed", "--no-warn-script-location", "-q", wheel],
         env=_clean_env(venv), cwd=tmp, timeout=300)
    return venv


def _group_members(pgid: int) -> list[str]:
    """Live processes (not zombies) whose process group is ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()     # state, ppid, pgrp, ...
        if entry.name.isdigit() and int(fields[2]) == pgid and fields[0] != "Z":
            found.append(f"{entry.name}: {stat[:80]}")
    return found


def test_the_installed_package_is_the_wheels(wheel_venv, tmp_path):
    done = _run([wheel_venv / "bin" / "python", "-c",
                 "import triton_disagg, triton_disagg.model_repo as m, "
                 "triton_disagg.launch.k8s_autoscale as k; "
                 "print(triton_disagg.__file__); print(m.__file__); print(k.DASHBOARD)"],
                env=_clean_env(wheel_venv), cwd=tmp_path)
    for path in done.stdout.split():
        assert Path(path).resolve().is_relative_to(wheel_venv.resolve()), done.stdout
        assert not Path(path).resolve().is_relative_to(ROOT), done.stdout


def test_serve_all_from_outside_the_checkout_answers(wheel_venv, demo_engine, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    work = tmp_path / "run"
    http_port, grpc_port, metrics_port = free_ports(3)
    cmd = [str(wheel_venv / "bin" / "triton-disagg"), "serve", "all", "--engine", str(demo_engine),
           "--http-port", str(http_port), "--grpc-port", str(grpc_port),
           "--metrics-port", str(metrics_port), "--work-dir", str(work)]
    expected = servers.offline_text(demo_engine)(PROMPT, MAX_TOKENS)
    with servers.serve_command(cmd, work, f"http://127.0.0.1:{http_port}",
                               f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{metrics_port}",
                               cwd=elsewhere, env=_clean_env(wheel_venv)) as served:
        status, body = servers.generate(served.http, {"text_input": PROMPT,
                                                      "max_tokens": MAX_TOKENS})
        assert status == 200, body
        assert body["text_output"] == expected
        pgid = served.process.pid
    # serve_command stopped it (SIGTERM to the CLI) and found nothing under its work dir
    assert served.process.returncode is not None
    assert not _group_members(pgid), _group_members(pgid)
    assert not servers.processes_under(work)


def test_launch_k8s_from_outside_the_checkout_ships_the_dashboard(wheel_venv, tmp_path):
    shutil.copy(ROOT / "disagg_config.yaml", tmp_path / "disagg_config.yaml")
    _run([wheel_venv / "bin" / "triton-disagg", "launch", "k8s", "-c", "disagg_config.yaml",
          "--image", "triton-disagg:cpu", "--out", "k8s"],
         env=_clean_env(wheel_venv), cwd=tmp_path, timeout=120)
    rendered = "".join(p.read_text() for p in sorted((tmp_path / "k8s").rglob("*")) if p.is_file())
    assert "grafana_dashboard" in rendered and "triton-disagg.json" in rendered

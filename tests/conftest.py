"""Session-wide fixtures: tiny checkpoints and engines, built once per test session.

Layers: tests/unit (start no process), tests/server (a real tritonserver or other local
processes), tests/cluster (root, network namespaces, etcd, Prometheus); each test is
marked with its folder's name. Helpers shared by the layers live in tests/support
(on sys.path through pyproject's ``pythonpath``).

Keys of ``tiny_checkpoints`` / ``tiny_engines``: "llama", "llama3" (llama3 rope
scaling), "qwen2", "mistral", "gpt2". Treat the directories as read-only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoints import MAKERS, build_engines, make_llama_checkpoint


LAYERS = ("unit", "server", "cluster")   # tests/<layer>/: each test is marked with its folder's


def pytest_collection_modifyitems(config, items):
    """Mark every test with its layer (the folder under tests/ it lives in), so that
    ``-m unit`` selects the same tests as ``tests/unit``."""
    root = Path(__file__).parent
    for item in items:
        layer = Path(item.fspath).relative_to(root).parts[0]
        if layer in LAYERS:
            item.add_marker(getattr(pytest.mark, layer))


def pytest_collection_finish(session):
    """Stop the run in seconds, with the one-line fix, when Triton's Python-backend stub
    cannot start on this host (every server test would otherwise time out in turn). Only
    a run that selected server or cluster tests checks: unit tests start no process."""
    if session.config.option.collectonly or not any(
            item.get_closest_marker("server") or item.get_closest_marker("cluster")
            for item in session.items):
        return
    from triton_disagg.errors import UserError
    from triton_disagg.triton.stub_check import check_stub
    from triton_disagg.triton.tritonserver import locate, server_env

    install = locate()
    try:
        check_stub(install.stub_binary, server_env(install))
    except UserError as exc:
        pytest.exit(f"cannot run the server tests: {exc}", returncode=2)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """family -> tiny random Hugging Face checkpoint directory (see tests/support/checkpoints.py)."""
    root = tmp_path_factory.mktemp("checkpoints")
    out = {family: make(root / family) for family, make in MAKERS.items()}
    out["llama3"] = make_llama_checkpoint(root / "llama3", llama3_rope=True)
    return out


@pytest.fixture(scope="session")
def tiny_engines(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """family -> float32 engine directory built from ``tiny_checkpoints[family]``."""
    return build_engines(tiny_checkpoints, tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory) -> Path:
    """The default demo checkpoint (seed 0), as `triton-disagg demo-checkpoint` writes it."""
    from triton_disagg.builders.demo import write_demo_checkpoint

    path = tmp_path_factory.mktemp("demo") / "checkpoint"
    write_demo_checkpoint(path)
    return path


@pytest.fixture(scope="session")
def demo_engine(demo_checkpoint) -> Path:
    """float32 engine directory built from ``demo_checkpoint``."""
    from triton_disagg.builders.build import build_engine

    path = demo_checkpoint.parent / "engine"
    build_engine(demo_checkpoint, path)
    return path


_SHM_SINCE = pytest.StashKey[float]()


def pytest_configure(config):
    import os
    import tempfile
    import time

    config.stash[_SHM_SINCE] = time.time()
    # The KV secret file the servers share (triton_disagg.kv.secret) goes in a folder of
    # this run, inherited by every server it starts, not in the user's ~/.config.
    os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="triton-disagg-tests-config-")


def pytest_unconfigure(config):
    import os
    import shutil

    shutil.rmtree(os.environ.pop("XDG_CONFIG_HOME", ""), ignore_errors=True)


def pytest_sessionfinish(session):
    """Fail the run when it left anything of the project's in /dev/shm (a staging area or
    a Triton region that outlived its server fills the tmpfs until stubs die of SIGBUS);
    the orphans among them are swept after they are named."""
    from shm_check import leftovers
    from triton_disagg import shm

    left = leftovers(session.config.stash[_SHM_SINCE])
    if left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.write("\n")
        reporter.write_sep("=", f"FAILED: the tests left {len(left)} entries in {shm.SHM_DIR}",
                           red=True, bold=True)
        reporter.write_line("\n".join(left))
        shm.sweep()

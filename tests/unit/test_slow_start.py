"""A stub's ``initialize`` that runs past its time writes every thread's stack to stderr
(tritonserver's log), once; one that returns in time writes nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

MODEL = textwrap.dedent("""
    import sys, time
    from triton_disagg.triton import slow_start
    slow_start.STACKS_AFTER_SECONDS = 0.3

    class TritonPythonModel:
        @slow_start.stacks_if_slow
        def initialize(self, args):
            time.sleep(float(args["sleep"]))
            return "started"

    print(TritonPythonModel().initialize({"sleep": sys.argv[1]}))
    time.sleep(0.5)                      # past the deadline again: nothing more comes
""")


def _start(sleep: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", MODEL, str(sleep)], capture_output=True,
                          text=True, timeout=60)


def test_a_start_that_hangs_writes_where_it_is():
    run = _start(1.0)
    assert run.returncode == 0 and run.stdout.strip() == "started"
    assert run.stderr.count("Timeout (0:00:00.300000)!") == 1, run.stderr
    assert "in initialize" in run.stderr


def test_a_start_in_time_writes_nothing():
    run = _start(0.0)
    assert run.returncode == 0 and run.stdout.strip() == "started"
    assert run.stderr == ""

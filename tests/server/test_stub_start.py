"""A stub's ``initialize`` as the log tells it (:mod:`triton_disagg.triton.stub_start`):
one that runs past its time writes every thread's stack once; one that returns says so
in one line serve can read back; one that raises writes its traceback; ``STACKS_SIGNAL``
writes every thread's stack at any time. Each runs in a child Python, as a stub would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from triton_disagg.log_format import FORMAT_ENV, ROLE_ENV
from triton_disagg.triton.stub_start import initialized_instance

MODEL = textwrap.dedent("""
    import os, signal, sys, time
    from triton_disagg.log_format import configure_stub
    from triton_disagg.triton import stub_start
    stub_start.STACKS_AFTER_SECONDS = 0.3

    class TritonPythonModel:
        @stub_start.watched_initialize
        def initialize(self, args):
            configure_stub(args["model_instance_name"])
            time.sleep(float(args["sleep"]))
            if args["fail"]:
                raise ValueError("no such engine")
            return "started"

    mode = sys.argv[2]
    try:
        print(TritonPythonModel().initialize({"model_instance_name": "generation_0_1",
                                              "sleep": sys.argv[1], "fail": mode == "fail"}))
    except ValueError:
        print("raised")
    if mode == "signal":
        os.kill(os.getpid(), stub_start.STACKS_SIGNAL)
    time.sleep(0.5)                      # past the deadline again: nothing more comes
""")


def _start(sleep: float, mode: str = "", log_format: str = "text") -> subprocess.CompletedProcess:
    env = dict(os.environ, **{FORMAT_ENV: log_format, ROLE_ENV: "generation"})
    return subprocess.run([sys.executable, "-c", MODEL, str(sleep), mode], capture_output=True,
                          text=True, timeout=60, env=env)


def test_a_start_that_hangs_writes_where_it_is():
    run = _start(1.0)
    assert run.returncode == 0 and run.stdout.strip() == "started"
    assert run.stderr.count("Timeout (0:00:00.300000)!") == 1, run.stderr
    assert "in initialize" in run.stderr


def test_a_start_in_time_writes_only_that_it_finished():
    run = _start(0.0)
    assert run.returncode == 0 and run.stdout.strip() == "started"
    (line,) = run.stderr.splitlines()
    assert initialized_instance(line) == "generation_0_1", run.stderr


def test_the_finished_line_is_json_in_json_mode_and_still_read_back():
    run = _start(0.0, log_format="json")
    (line,) = run.stderr.splitlines()
    record = json.loads(line)
    assert record["instance"] == "generation_0_1" and record["level"] == "INFO"
    assert initialized_instance(line) == "generation_0_1"


def test_a_start_that_raises_writes_its_traceback_and_no_finished_line():
    run = _start(0.0, "fail")
    assert run.stdout.strip() == "raised"
    assert "model instance generation_0_1 failed to initialize" in run.stderr
    assert "ValueError: no such engine" in run.stderr
    assert not any(initialized_instance(line) for line in run.stderr.splitlines())


def test_the_stacks_signal_writes_every_thread():
    run = _start(0.0, "signal")
    assert run.returncode == 0, run.stderr
    assert "Current thread" in run.stderr and "<module>" in run.stderr, run.stderr

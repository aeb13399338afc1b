"""serve's stub watch on real child processes (this test process plays tritonserver): a
model instance's stub is listed, Triton's auto-complete stub (named after the model alone)
is not, and a stub killed and not yet reaped is a zombie that no listing names any more,
while :func:`first_dead` still finds it among the stubs listed before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from triton_disagg.triton.stub_watch import (STUB_BINARY, first_dead, model_instance_stubs,
                                             stubs_of)
from waiting import wait_until

# A unit test though it starts processes: each child is trivially a fake stub (this Python,
# sleeping, under the stub binary's name and argv), nothing of the project runs in it.


def _stub(binary, instance: str) -> subprocess.Popen:
    """A child whose argv is a stub's: the binary, ..., the instance, one more argument."""
    return subprocess.Popen([str(binary), "-c", "import time; time.sleep(60)", instance, "x"])


def _state(pid: int) -> str:
    text = open(f"/proc/{pid}/stat").read()
    return text[text.rindex(")") + 2]


def test_instances_are_listed_and_a_killed_one_is_found_dead(tmp_path):
    binary = tmp_path / STUB_BINARY
    binary.symlink_to(sys.executable)
    instance, autocomplete = _stub(binary, "orchestrator_0_0"), _stub(binary, "orchestrator")
    try:
        wait_until(lambda: len(stubs_of(os.getpid())) >= 2, 10, "both stubs listed")
        assert sorted(s.instance for s in stubs_of(os.getpid())) == ["orchestrator",
                                                                     "orchestrator_0_0"]
        listed = model_instance_stubs(os.getpid())
        assert [(s.pid, s.instance) for s in listed] == [(instance.pid, "orchestrator_0_0")]
        assert first_dead(listed) is None
        os.kill(instance.pid, signal.SIGKILL)
        wait_until(lambda: _state(instance.pid) == "Z", 10, "not reaped: a zombie")
        assert model_instance_stubs(os.getpid()) == []        # no listing names it now
        assert first_dead(listed) == listed[0]                # the earlier listing does
    finally:
        for child in (instance, autocomplete):
            child.kill()
            child.wait()

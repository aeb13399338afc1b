"""Where `serve all` runs on a real tritonserver: the front end (tritonserver's threads,
the preprocessing and orchestrator stubs it forks) on ``scheduler_server.cpus`` or,
by default, off generation's cores; context and generation stubs on their own cores, or
on every usable core when given none, every thread of each (read from
``/proc/PID/task/*/status``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import servers
from triton_disagg.config.disagg import parse_config
from triton_disagg.triton.render import instance_cpus
from triton_disagg.triton.stub_watch import children_running, stubs_of

pytestmark = pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0),
                                reason="needs cores 0 and 1")

PLACED = "context_server: {cpus: [0]}\ngeneration_server: {cpus: [1]}\n"


def thread_cores(pid: int) -> set[frozenset[int]]:
    """The distinct ``Cpus_allowed_list`` of ``pid``'s threads, as sets of cores."""
    masks = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue                    # a thread that ended meanwhile
        listed = next(line.split(":", 1)[1].strip() for line in status.splitlines()
                      if line.startswith("Cpus_allowed_list"))
        masks.add(frozenset(_cores(listed)))
    return masks


def _cores(listed: str) -> set[int]:
    """``"0-2,5"`` -> {0, 1, 2, 5}."""
    cores = set()
    for part in listed.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def placement_of(served: servers.Served) -> dict[str, set[frozenset[int]]]:
    """``{"tritonserver": masks, "generation_0_0": masks, ...}`` of a running `serve`."""
    [(server_pid, _)] = children_running(served.process.pid, "tritonserver")
    return {"tritonserver": thread_cores(server_pid),
            **{stub.instance: thread_cores(stub.pid) for stub in stubs_of(server_pid)}}


def on(*cores: int) -> set[frozenset[int]]:
    """Every thread on exactly ``cores``."""
    return {frozenset(cores)}


@pytest.mark.parametrize("placement, front, context, generation", [
    (PLACED, 0, 0, 1),                                       # default: beside the prefill
    (PLACED + "scheduler_server: {cpus: [1]}\n", 1, 0, 1),   # as given
    ("scheduler_server: {cpus: [1]}\n", 1, None, None),      # unpinned: every usable core
], ids=["default", "given", "unpinned-models"])
def test_front_end_and_stubs_run_on_their_cores(demo_engine, tmp_path, placement, front,
                                                context, generation):
    anywhere = sorted(os.sched_getaffinity(0))
    with servers.serve_config(f"model: {{engine: {demo_engine}}}\n{placement}", tmp_path) as served:
        status, body = servers.generate(served.http, {"text_input": servers.PROMPTS[0],
                                                      "max_tokens": 8})
        placed = placement_of(served)
        log = served.log.read_text()
    assert status == 200 and body["text_output"] == servers.offline_text(demo_engine)(
        servers.PROMPTS[0], 8), body
    assert placed == {"tritonserver": on(front), "preprocessing_0_0": on(front),
                      "orchestrator_0_0": on(front),
                      "context_0_0": on(*anywhere) if context is None else on(context),
                      "generation_0_0": on(*anywhere) if generation is None else on(generation),
                      }, placed
    assert f"front end (tritonserver, preprocessing, orchestrator) on cores [{front}]" in log


def test_instances_without_cores_undo_the_front_ends_only_where_it_is_pinned(tmp_path):
    (tmp_path / "engine.json").write_text("{}")
    base = {"model": {"engine": str(tmp_path)}, "generation_server": {"cpus": [1]}}
    anywhere = sorted(os.sched_getaffinity(0))
    assert instance_cpus("context", "all", parse_config(base)) == [anywhere]
    assert instance_cpus("generation", "all", parse_config(base)) == [[1]]
    assert instance_cpus("context", "context", parse_config(base)) == [[]]
    assert instance_cpus("context", "all", parse_config({**base, "generation_server": {}})) == [[]]

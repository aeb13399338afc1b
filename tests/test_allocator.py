"""tritonserver and its stubs run with jemalloc where the host has it (launch/allocator.py):
glibc's malloc keeps tritonserver's memory growing under streaming load."""

from __future__ import annotations

from pathlib import Path

import serving
from triton_disagg.launch import allocator


def test_preload_puts_the_library_first_and_keeps_what_was_there():
    env = {"LD_PRELOAD": "libfoo.so libjemalloc.so.2"}
    allocator.preload(env, "libjemalloc.so.2")
    assert env["LD_PRELOAD"] == "libjemalloc.so.2 libfoo.so"
    empty: dict[str, str] = {}
    allocator.preload(empty, None)
    assert empty == {}


def test_a_served_tritonserver_and_its_stubs_map_jemalloc(demo_engine, tmp_path):
    assert allocator.jemalloc(), (f"jemalloc is not installed: apt-get install "
                                  f"{allocator.PACKAGE} (make test's doctor does it as root)")
    with serving.serve("all", ["--engine", str(demo_engine)], tmp_path) as served:
        pids = [int(p.split(":")[0]) for p in serving.processes_under(served.work_dir)
                if "bin/tritonserver" in p or "python_backend_stub" in p]   # not serve itself
        mapped = {pid: "jemalloc" in Path(f"/proc/{pid}/maps").read_text() for pid in pids}
    assert len(mapped) >= 5 and all(mapped.values()), mapped    # tritonserver + 4 stubs

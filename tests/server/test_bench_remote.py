"""`bench remote` for real: `serve all` and the three roles' `serve` commands (scheduler ->
gRPC -> context and generation) side by side on the demo engine, a tiny serial set
through each, and the section it writes: one row per deployment with the client's TTFT
and TPOT p50, and the TTFT the remote path added. Its processes are all gone after."""

from __future__ import annotations

import re
import subprocess
import sys

import servers


def test_bench_remote_writes_both_deployments_and_what_the_remote_path_added(demo_engine,
                                                                              tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n")
    work = tmp_path / "work"
    done = subprocess.run([sys.executable, "-m", "triton_disagg.cli", "bench", "remote",
                           "--engine", str(demo_engine), "--requests", "3", "--runs", "2",
                           "--work-dir", str(work), "--output", str(doc)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(re.findall(r"run \d/2 +(serve all|remote): TTFT p50", done.stderr)) == 4
    text = doc.read_text()
    rows = dict(re.findall(r"^\| (serve all|remote) \| (\d+\.\d) \| \d+\.\d\d \|$", text, re.M))
    assert set(rows) == {"serve all", "remote"} and all(float(v) > 0 for v in rows.values())
    found = re.search(r"remote path: \*\*([+-]\d+\.\d) ms\*\* at p50 \((holds|misses) the <= 5 ms",
                      text)
    added = float(found[1])
    assert abs(added - (float(rows["remote"]) - float(rows["serve all"]))) <= 0.11
    assert (found[2] == "holds") == (added <= 5.0)
    assert not servers.processes_under(work)

"""`triton-disagg bench overlap --link-mbit` as a user runs it (root): both deployments
across two network-namespace hosts, the context's link shaped, one short request per
deployment, one round. It prints a table row with both deployments' figures (the greedy
texts matched, or it would have failed), and leaves no namespace and no process behind."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import servers
from triton_disagg.launch.netns import PREFIX

LINK_MBIT = 20       # 64 tokens of the demo engine's KV (256 KiB) take ~0.1 s on it
ROW = re.compile(r"^\| 20 Mbit/s \| 64 \| (\d+) / (\d+) ms \| (\d+) ms \| (\d+) ms \| "
                 r"([\d.]+) \| ([\d.]+) \(\*\*([\d.]+)\*\*\) \| ([\d.]+) ms \| ([\d.]+) ms \| "
                 r"(-?\d+)% \|$", re.MULTILINE)


def _namespaces_of(pid: int) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines()
            if line.startswith(f"{PREFIX}{pid}-")]


def test_bench_overlap_across_a_shaped_link(demo_engine, tmp_path):
    work = tmp_path / "work"
    proc = subprocess.Popen(
        [sys.executable, "-m", "triton_disagg.cli", "bench", "overlap", "--engine",
         str(demo_engine), "--prompt-tokens", "64", "--requests", "1", "--rounds", "1",
         "--link-mbit", str(LINK_MBIT), "--work-dir", str(work)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=600)
    print(err[-3000:])
    assert proc.returncode == 0, err[-3000:]
    (row,) = ROW.findall(out)
    first_without, first_with, second_without, second_with = map(int, row[:4])
    assert 0 < first_without <= second_without and 0 < first_with <= second_with
    assert float(row[4]) == pytest.approx(second_with / second_without, rel=0.05)  # ms rounded
    assert float(row[5]) == pytest.approx(float(row[6]), abs=0.01)     # one round: one pair
    assert "every reply's greedy text was the same with and without overlap" in out
    assert f"shaped to {LINK_MBIT:g} Mbit/s" in err
    sent = re.search(r"the hosts sent context ([\d.]+) MB, generation ([\d.]+) MB", err)
    assert float(sent[1]) > float(sent[2])         # the KV flows context -> generation
    assert not _namespaces_of(proc.pid)
    assert not servers.processes_under(work)

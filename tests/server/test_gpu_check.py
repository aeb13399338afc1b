"""scripts/gpu_check.py does not rot: its CPU smoke run (tiny shapes, NIXL between two
real processes over DRAM, bfloat16 parity runners on CPU) writes every table, parity
holds, a section that raises leaves the other tables in the file, and --device cuda on a
host without a GPU is one line and exit 2."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))


def test_cpu_smoke_run_writes_every_table(tmp_path):
    output = tmp_path / "gpu_check.md"
    subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--output",
                    str(output)], check=True, capture_output=True, text=True, timeout=600)
    text = output.read_text()
    assert "- torch " in text and "cuDNN " in text                      # the versions
    parity = re.findall(r"^\| (\w+) \| torch cpu float32 \| serving \| flash \(CPU\) \| "
                        r"(\d+)/(\d+) \| [\d.e+-]+ \| \| \| (\w+) \|$", text, re.M)
    assert [row[0] for row in parity] == ["llama", "llama3", "qwen2", "mistral", "gpt2"]
    assert all(row[1] == row[2] and row[3] == "ok" for row in parity), parity
    low = re.findall(r"^\| (\w+) \| torch cpu bfloat16 \| (serving|torch default)[^|]* \| "
                     r"flash \(CPU\) \| (\d+)/24 \| [\d.e+-]+ \| [\d.e+-]+ \| ([\d.]*) \| "
                     r"(\w+) \|$", text, re.M)
    assert len(low) == 10 and all(row[-1] == "ok" for row in low), low   # 5 x 2 backends
    assert all(row[2] == "24" or row[3] for row in low)   # a divergence states its margin
    backends = re.findall(r"^\| (prefill|decode)[^|]* \| (serving|torch default)[^|]* \| "
                          r"(.+) \|$", text, re.M)
    assert len(backends) == 6 and {b[2] for b in backends} == {"flash (CPU)"}
    speed = re.findall(r"^\| tiny-llama-shaped \| (prefill|decode) \| (\d+) \| ([\d,.]+) \| "
                       r"([\d,.]+) \| ([\d.]+)x \|", text, re.M)
    assert [(what, int(batch)) for what, batch, *_ in speed] == [
        ("prefill", 1), ("decode", 1), ("decode", 4)]
    assert all(float(ours.replace(",", "")) > 0 for *_, ours, _, _ in speed)
    nixl = re.search(r"^\| NIXL READ from another process \(UCX, DRAM\) \| ([\d.]+) \|", text, re.M)
    assert nixl and float(nixl.group(1)) > 0
    assert "| weights and KV pool placed | cpu | cpu | ok |" in text
    assert "| engine freed by del, before garbage collection | KV pool unreferenced | " \
           "unreferenced | ok |" in text
    assert "every section ran" in text
    assert "| llama | float32 | 16/16 | ok |" in text           # the staged handoff
    assert "| host_memory | 16/16 | ok |" in text               # disaggregated = aggregated
    assert "| direct_transfer | 16/16 | ok |" in text


def test_cuda_without_a_gpu_is_one_line(tmp_path):
    if torch.cuda.is_available():
        return  # a GPU host runs the real check instead
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--output",
                           str(tmp_path / "out.md")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "sees no CUDA GPU" in done.stderr


def test_a_section_that_raises_leaves_the_other_tables_in_the_file(tmp_path, monkeypatch):
    """Each section is written as soon as it ends; one that raises is its error and
    traceback in its table's place, the sections after it still run, exit status 1."""
    import gpu_check

    def broken(args, say):
        raise RuntimeError("cuDNN plan failed (a stand-in)")

    title, _ = gpu_check.SECTIONS["memory"]
    monkeypatch.setitem(gpu_check.SECTIONS, "memory", (title, broken))
    output = tmp_path / "gpu_check.md"
    written_before_handoff = []
    real_handoff = gpu_check.SECTIONS["handoff"]

    def handoff(args, say):     # what the file holds while the last section runs
        written_before_handoff.append(output.read_text())
        return real_handoff[1](args, say)

    monkeypatch.setitem(gpu_check.SECTIONS, "handoff", (real_handoff[0], handoff))
    status = gpu_check.main(["--device", "cpu", "--tiny", "--sections",
                             "attention,memory,handoff", "--output", str(output)])
    text = output.read_text()
    assert status == 1
    assert "**FAILED**: `RuntimeError: cuDNN plan failed (a stand-in)`" in text
    assert "Traceback (most recent call last)" in text and "in broken" in text
    assert "| llama | float32 | 16/16 | ok |" in text                  # the section after
    assert "sections that failed: memory" in text
    (before,) = written_before_handoff
    assert "| decode, one length (no mask) |" in before and "**FAILED**" in before

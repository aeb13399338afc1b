"""`bench engine`: a tiny real run on the demo model writes its section (one table per
runtime), and the target verdicts follow the measured ratios."""

from __future__ import annotations

import re
import subprocess
import sys

from triton_disagg.bench.engine_bench import HF, BenchRow, format_report


def test_tiny_run_writes_the_engine_section(tmp_path):
    output = tmp_path / "benchmarks.md"
    output.write_text("# Benchmarks\n\nkept text\n")
    subprocess.run([sys.executable, "-m", "triton_disagg.cli", "bench", "engine",
                    "--models", "demo", "--batch-sizes", "1,2", "--prompt-len", "8",
                    "--new-tokens", "4", "--threads", "1", "--repeats", "1",
                    "--runtime", "numpy,torch", "--work-dir", str(tmp_path / "work"),
                    "--output", str(output)], check=True, capture_output=True, text=True,
                   timeout=600)
    text = output.read_text()
    assert "kept text" in text
    assert text.index("`numpy` runtime:") < text.index("`torch` runtime:")
    rows = re.findall(r"^\| demo \| (\d+) \| ([\d,.]+) \| ([\d,.]+) \| ([\d.]+)x "
                      r"\| ([\d,.]+) \| ([\d,.]+) \| ([\d.]+)x \|$", text, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 1, 2]      # numpy's table, then torch's
    for _, ep, hp, pr, ed, hd, dr in rows:
        engine_prefill, hf_prefill = (float(v.replace(",", "")) for v in (ep, hp))
        engine_decode, hf_decode = (float(v.replace(",", "")) for v in (ed, hd))
        assert min(engine_prefill, hf_prefill, engine_decode, hf_decode) > 0
        assert abs(float(dr) - engine_decode / hf_decode) < 0.01 + 0.01 * float(dr)
    for name in ("numpy", "torch", "transformers"):
        assert re.search(rf"^\| demo \| {name} \| 14 \| [\d,.]+ \| [\d,.]+ \| \d+% \|$",
                         text, re.M)


def test_target_verdicts_follow_the_ratios():
    prefill = {"numpy": 1.0, "torch": 1.0, HF: 1.0}
    rows = [BenchRow("gpt2-small", 1, prefill, {"numpy": 48.0, "torch": 36.0, HF: 40.0}),
            BenchRow("gpt2-small", 8, prefill, {"numpy": 300.0, "torch": 150.0, HF: 140.0})]
    report = format_report(rows, {"gpt2-small": (495_000_000, 60.0)}, 30e9, 2, 64, 32)
    assert "batch 1 at least 3x transformers: 1.20x, misses" in report
    assert "transformers itself runs at 67% of the roofline" in report
    assert "no implementation can exceed 1.5x at batch 1" in report
    assert "batch 1 at least 75% of the roofline: 80%, holds" in report
    assert "batch 8 at least 2x transformers: 2.14x, holds" in report
    assert "torch runtime at least transformers at batch 1: 0.90x, misses" in report
    assert "torch runtime at least transformers at batch 8: 1.07x, holds" in report

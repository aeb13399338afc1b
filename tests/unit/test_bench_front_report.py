"""`bench front`'s table: TTFT p50 added by the front and its throughput ratio to gRPC."""

from __future__ import annotations

import argparse

from triton_disagg.bench.front_bench import PATHS, report
from triton_disagg.bench.serve_stats import Percentiles, Summary


def _summary(path: str, ttft_ms: float, tokens_per_s: float) -> Summary:
    p = Percentiles(ttft_ms / 1e3, 2 * ttft_ms / 1e3, 3 * ttft_ms / 1e3)
    return Summary(path, 0.0, 4, 0, 1.0, 4.0, tokens_per_s, p, None, None, 1.0)


def test_report_gives_the_added_ttft_and_the_ratio():
    best = {(PATHS[0], "serial"): _summary(PATHS[0], 20.0, 0), (PATHS[0], "burst"): _summary(PATHS[0], 0, 800),
            (PATHS[1], "serial"): _summary(PATHS[1], 21.5, 0), (PATHS[1], "burst"): _summary(PATHS[1], 0, 720)}
    args = argparse.Namespace(prompt_tokens="32", output_tokens="16", serial_requests=4,
                              burst_requests=8)
    text = report(best, [0, 1], args)
    assert "| gRPC stream (ensemble) | 20.0 | 40.0 | 800 |" in text
    assert "| OpenAI SSE (front) | 21.5 | 43.0 | 720 |" in text
    assert "**+1.5 ms**" in text and "**0.90x**" in text

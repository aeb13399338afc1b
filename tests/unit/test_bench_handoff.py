"""`bench handoff`'s table math, without a server: the p50 bucket from cumulative counts,
histogram deltas between two scrapes, bandwidth and its share of memcpy and of
process_vm_readv."""

from __future__ import annotations

import random

import pytest

from triton_disagg.bench.handoff import (Row, exact_prompt, histogram_delta, markdown, p50_bucket,
                                         verdict)
from triton_disagg.routing.scrape import parse_metrics

INF = float("inf")


def test_p50_bucket_is_the_first_bound_reaching_half():
    assert p50_bucket([(0.001, 3), (0.0025, 10), (0.005, 20), (INF, 20)]) == 0.0025
    assert p50_bucket([(0.001, 10), (0.0025, 10), (INF, 20)]) == 0.001     # exactly half
    assert p50_bucket([(0.001, 0), (0.0025, 1), (INF, 3)]) == INF          # most above every bound
    assert p50_bucket([(0.001, 1), (INF, 1)]) == 0.001
    with pytest.raises(ValueError):
        p50_bucket([(0.001, 0), (INF, 0)])


def _scrape(buckets: dict[str, int], total: float, other_instance: int = 0) -> dict:
    lines = []
    for le, count in buckets.items():
        lines.append(f'disagg_kv_transfer_seconds_bucket{{model_instance="g_0",le="{le}",'
                     f'role="generation",strategy="direct_transfer"}} {count}')
        lines.append(f'disagg_kv_transfer_seconds_bucket{{model_instance="g_1",le="{le}",'
                     f'role="generation",strategy="direct_transfer"}} {other_instance}')
        lines.append(f'disagg_kv_transfer_seconds_bucket{{model_instance="g_0",le="{le}",'
                     f'role="generation",strategy="host_memory"}} 99')
    count = list(buckets.values())[-1]
    lines += [f'disagg_kv_transfer_seconds_sum{{model_instance="g_0",role="generation",'
              f'strategy="direct_transfer"}} {total}',
              f'disagg_kv_transfer_seconds_count{{model_instance="g_0",role="generation",'
              f'strategy="direct_transfer"}} {count}']
    return parse_metrics("\n".join(lines))


def test_histogram_delta_sums_instances_of_one_strategy_between_scrapes():
    before = _scrape({"0.001": 1, "0.0025": 2, "+Inf": 2}, 0.003)
    after = _scrape({"0.001": 3, "0.0025": 8, "+Inf": 10}, 0.033, other_instance=2)
    cumulative, seconds, count = histogram_delta(before, after, "disagg_kv_transfer_seconds",
                                                 strategy="direct_transfer")
    assert cumulative == [(0.001, 4.0), (0.0025, 8.0), (INF, 10.0)]   # g_1 added 2 to each
    assert seconds == pytest.approx(0.03) and count == 8
    assert p50_bucket(cumulative) == 0.0025


def test_bandwidth_and_share_of_memcpy_and_of_process_vm_readv():
    row = Row("direct_transfer", 2000, 40, 0.0025, mean_s=0.002, bytes_per=8_192_000,
              memcpy_gbps=8.192, vm_readv_gbps=5.12)
    staged = Row("host_memory", 2000, 40, 0.0015, mean_s=0.001, bytes_per=8_192_000,
                 memcpy_gbps=8.192, vm_readv_gbps=5.12)
    assert row.gbps == pytest.approx(4.096)         # 8.192 MB in 2 ms
    assert row.of_memcpy == pytest.approx(0.5)
    assert row.of_vm_readv == pytest.approx(0.8)
    assert staged.of_vm_readv is None                # not a NIXL READ: no share shown
    table = markdown([row, staged], "engines/demo", [0, 1], 40)
    assert ("| GB/s | memcpy GB/s | % of memcpy | process_vm_readv GB/s | % of process_vm_readv |"
            "\n|---|---|---|---|---|---|---|---|---|---|---|\n" in table)
    assert ("| direct_transfer | 2000 | 40 | ≤ 2.5 ms | 2.00 ms | 8000 | 4.10 | 8.2 | 50.0% "
            "| 5.1 | 80.0% |" in table)
    assert ("| host_memory | 2000 | 40 | ≤ 1.5 ms | 1.00 ms | 8000 | 8.19 | 8.2 | 100.0% "
            "| 5.1 | – |" in table)
    assert "cma transport" in table and "n/a" not in table
    assert "≥ 50% of memcpy at 2,000 tokens holds (50.0%)" in table


def test_refused_process_vm_readv_is_na_with_its_reason_once():
    why = "process_vm_readv: EPERM (Operation not permitted); needs ptrace permission"
    rows = [Row("direct_transfer", n, 40, 0.0025, 0.002, 8_192_000, 8.192, None, why)
            for n in (64, 2000)]
    table = markdown(rows, "engines/demo", [0, 1], 40)
    assert "| 8.2 | 50.0% | n/a | – |" in table
    assert table.count(f"process_vm_readv n/a: {why}.") == 1
    assert table.rstrip().endswith("≥ 50% of memcpy at 2,000 tokens holds (50.0%).")


def test_verdict_on_issue_9_targets():
    short = Row("direct_transfer", 64, 40, 0.0015, 0.0012, 262_144, 40.0, 10.0)
    slow = Row("direct_transfer", 64, 40, 0.0025, 0.0024, 262_144, 40.0, 10.0)
    long = Row("direct_transfer", 2000, 40, 0.005, 0.003, 8_192_000, 30.0, 10.0)
    other = Row("host_memory", 64, 40, 0.0005, 0.0003, 262_144, 40.0, 10.0)
    assert verdict([short, long, other]) == (
        "Issue 9's direct_transfer targets: p50 ≤ 2 ms at 64 tokens holds (≤ 1.5 ms); "
        "≥ 50% of memcpy at 2,000 tokens MISSES (9.1%).")
    assert "64 tokens MISSES (≤ 2.5 ms)" in verdict([slow])
    assert verdict([other]) == ""


def test_exact_prompt_reencodes_to_the_length(tmp_path):
    from triton_disagg.builders.demo import write_demo_tokenizer
    from triton_disagg.front.tokenizer import Tokenizer

    write_demo_tokenizer(tmp_path)
    tok, rng = Tokenizer(tmp_path), random.Random(0)
    for n in (1, 2, 64, 2000):
        for _ in range(8):
            assert len(tok.encode(exact_prompt(tok, n, rng))) == n

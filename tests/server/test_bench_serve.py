"""`bench serve`: its statistics, where its rate sweep stops, and tiny runs of both modes end
to end (report structure and plausible values; a sweep stopped by a missed SLO)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re

import pytest

from triton_disagg.bench import serve_cli
from triton_disagg.clients.load import LoadRun, Outcome, arrival_times
from triton_disagg.bench.serve_inproc import InProcessEngine
from triton_disagg.bench.serve_report import (IN_PROCESS_CONTEXT, Round, SplitBaseline,
                                               overhead_lines)
from triton_disagg.bench.serve_servers import placement
from triton_disagg.bench.serve_stats import (SLO, Percentiles, Summary, Sweep, best_index,
                                              goodput, summarize, verdicts)
from triton_disagg.clients.stream import GenerateRequest, Measurement
from triton_disagg.errors import UserError


def _measured(ttft: float, gaps: list[float]) -> Measurement:
    m = Measurement(start=0.0)
    at = ttft
    m.on_response("a", 3, 1, at=at)
    for i, gap in enumerate(gaps):
        at += gap
        m.on_response("b", 3, i + 2, at=at)
    m.end = at
    return m


def _row(rate: float, attainment: float, mode: str = "m") -> Summary:
    return Summary(mode, rate, 1, 0, 1, 1, 1, None, None, None, attainment)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    serve_cli.add_serve_parser(parser.add_subparsers(dest="kind"))
    return parser


def test_summary_attainment_and_goodput():
    slo = SLO(ttft=0.1, tpot=0.02)
    ok, slow_first, slow_tokens = _measured(0.05, [0.01] * 4), _measured(0.2, [0.01]), \
        _measured(0.05, [0.05, 0.05])
    outcomes = [Outcome(GenerateRequest("p", 5), m) for m in (ok, slow_first, slow_tokens)]
    outcomes.append(Outcome(GenerateRequest("p", 5), error="boom"))
    s = summarize("aggregated", LoadRun(4.0, outcomes, duration=2.0), slo)
    assert (s.sent, s.failed, s.errors) == (4, 1, ("boom",))
    assert s.attainment == 0.25 and s.request_throughput == 1.5
    assert s.token_throughput == pytest.approx((5 + 2 + 3) / 2.0)
    assert s.ttft.p50 == pytest.approx(0.05) and s.ttft.p99 <= 0.2
    assert Percentiles.of([]) is None

    assert goodput([_row(2, 1.0), _row(4, 0.95), _row(8, 0.5), _row(math.inf, 1.0),
                    _row(0, 1)]) == 4
    assert goodput([_row(2, 0.1)]) is None


def test_metrics_parsing_and_model_times():
    from triton_disagg.routing.scrape import model_times, parse_metrics, total

    def text(n):
        return "\n".join([
            "# TYPE nv_inference_exec_count counter",
            f'nv_inference_exec_count{{model="postprocessing",version="1"}} {n}',
            f'nv_inference_exec_count{{model="ensemble",version="1"}} {n}',
            f'nv_inference_compute_infer_duration_us{{model="postprocessing",version="1"}} {n * 1000}',
            f'nv_inference_queue_duration_us{{model="postprocessing",version="1"}} {n * 10}',
            f'disagg_kv_blocks_used{{model_instance="generation_0_0",role="generation"}} {n}',
            'disagg_kv_blocks_used{model_instance="context_0_0",role="context"} 1'])
    before, after = parse_metrics(text(10)), parse_metrics(text(30))
    assert total(after, "disagg_kv_blocks_used") == 31
    assert total(after, "disagg_kv_blocks_used", role="context") == 1
    (row,) = model_times(before, after)
    assert (row.model, row.executions) == ("postprocessing", 20)
    assert row.compute_seconds == pytest.approx(0.02) and row.queue_seconds == pytest.approx(2e-4)


def test_poisson_arrivals_and_placement():
    times = arrival_times(4000, 10.0, random.Random(0))
    assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:], strict=False))
    assert times[-1] / 3999 == pytest.approx(0.1, rel=0.05)
    assert arrival_times(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]
    assert placement("disaggregated", [0, 1]) == {
        "context_server": {"cpus": [0]}, "scheduler_server": {"cpus": [0]},
        "generation_server": {"cpus": [1], "stream_interval": 1}}
    assert placement("disaggregated", [3], 4) == {
        "context_server": {"cpus": [3]}, "scheduler_server": {"cpus": [3]},
        "generation_server": {"cpus": [3], "stream_interval": 4}}
    assert placement("aggregated", [0, 1]) == {
        "generation_server": {"cpus": [0, 1], "instances": 1, "stream_interval": 1}}
    for mode in ("aggregated", "disaggregated"):     # --front-cpus: cores of its own in both
        assert placement(mode, [0, 1], 1, front=[2, 3])["scheduler_server"] == {"cpus": [2, 3]}


def test_tiny_sweep_writes_a_plausible_report(demo_engine, tmp_path):
    parser = _parser()
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text("# Benchmarks\n\nkept text\n")
    args = parser.parse_args([
        "serve", "--engine", str(demo_engine), "--rates", "2,4", "--duration", "2",
        "--serial-requests", "3", "--burst-requests", "6", "--prompt-tokens", "uniform:8,24",
        "--output-tokens", "uniform:4,12", "--work-dir", str(tmp_path / "work"),
        "--output", str(doc), "--json", str(tmp_path / "serve.json")])
    assert args.func(args) == 0

    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nkept text") and "<!-- bench:serve:start -->" in text
    for heading in ("Request-rate sweep", "Goodput", "Serving overhead", "acceptance",
                    "Where the CPU went"):
        assert heading in text
    cpu = {tuple(c.strip() for c in line.split("|")[1:3]): float(line.split("|")[3])
           for line in text.splitlines() if re.match(r"\| (dis)?aggregated \| [a-z]", line)
           and line.count("|") == 5}
    for process in ("context_0_0", "generation_0_0", "orchestrator_0_0", "tritonserver",
                    "client (this benchmark)"):
        assert cpu[("disaggregated", process)] > 0, process
    assert ("aggregated", "context_0_0") not in cpu and cpu[("aggregated", "generation_0_0")] > 0
    assert "Rates: 2, 4 req/s (--rates), every rate for every mode" in text
    for mode in ("disaggregated", "aggregated"):
        assert f"- **{mode}** (median of 3 paired rounds): TTFT p50" in text
        assert re.search(rf"- \*\*{mode}\*\* (missed the SLO first at|met the SLO at every "
                         rf"swept rate, up to 4 req/s)", text), mode
        for rate in ("serial", "2", "4", "burst"):
            assert f"| {mode} | {rate} |" in text
    assert "  - the split: prefilled in-process on the context's core(s) 0, TTFT p50" in text
    assert re.search(r"  - the split: the engine's decode steps alone on generation's core\(s\) "
                     r"1 .* make [1-9]\d* output tok/s, (above|below)", text)
    for png in ("serve_latency.png", "serve_throughput.png"):
        data = (doc.parent / "img" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        assert f"](img/{png})" in text

    rows = json.loads((tmp_path / "serve.json").read_text())["summaries"]
    assert [(r["mode"], r["rate"]) for r in rows] == [
        ("in-process", 0), ("in-process", math.inf), ("in-process, context's cores", 0),
        *[(m, r) for m in ("disaggregated", "aggregated") for r in (0, 2.0, 4.0, math.inf)]]
    sent = {0: 3, 2.0: 4, 4.0: 8, math.inf: 6}
    for r in rows:
        assert r["failed"] == 0 and r["sent"] == sent[r["rate"]], r
        ttft, tpot = r["ttft"], r["tpot"]
        assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"] < 30, r
        assert 0 < tpot["p50"] <= tpot["p99"] < 5, r
        assert r["token_throughput"] > 0 and 0 <= r["attainment"] <= 1


def _timed(mode: str, rate: float, ttft: float, tokens_per_s: float) -> Summary:
    p = Percentiles(ttft, ttft, ttft)
    return Summary(mode, rate, 1, 0, 1, 1, tokens_per_s, p, p, p, 1.0)


def test_overhead_takes_the_median_paired_round_and_the_split_says_what_binds():
    rounds = {"disaggregated": [Round(0.010, 0.021, 2000, 1200),     # +11 ms, 40% lost
                                Round(0.008, 0.030, 1500, 1400),     # +22 ms, 7% lost
                                Round(0.012, 0.016, 2500, 1000)]}    # +4 ms, 60% lost
    rows = [_timed(IN_PROCESS_CONTEXT, 0, 0.013, 80), _timed("disaggregated", 0, 0.021, 90)]
    split = SplitBaseline((0,), (1,), decode_ceiling=1500.0)
    lines = overhead_lines(rows, ["disaggregated"], 4, rounds, split)
    assert lines[0].startswith("- **disaggregated** (median of 3 paired rounds): TTFT p50 "
                               "21.0 ms vs 10.0 ms in-process, +11.0 ms (misses")
    assert "1200 vs 2000 output tok/s, 40% lost (misses the <= 10% target)" in lines[0]
    assert "all rounds: +11.0 ms / 40%, +22.0 ms / 7%, +4.0 ms / 60%." in lines[0]
    assert "core(s) 0, TTFT p50 is 13.0 ms, so serving adds +8.0 ms" in lines[1]
    assert ("make 1500 output tok/s, below the target's 1800: no server with this split can "
            "meet it on these cores; disaggregated serving streamed 80% of that ceiling") in lines[2]
    above = overhead_lines(rows, ["disaggregated"], 1, rounds, split)   # target 70% of 2000
    assert "make 1500 output tok/s, above the target's 1400" in above[2]
    assert len(overhead_lines(rows, ["disaggregated"], 4, rounds)) == 1    # no split measured
    assert overhead_lines(rows, ["aggregated"], 4, rounds) == ["No paired rounds in this run."]


def test_best_run_is_the_fastest_first_token_serially_and_the_most_tokens_in_a_burst():
    serial = [_timed("m", 0, t, 100) for t in (0.030, 0.012, 0.020)]
    assert best_index(serial) == 1
    burst = [_timed("m", math.inf, 0.5, tps) for tps in (900, 1500, 1200)]
    assert best_index(burst) == 1
    failed = dataclasses.replace(burst[1], failed=1)
    assert best_index([burst[0], failed]) == 0


def test_decode_rate_counts_decode_steps_only(demo_engine):
    engine = InProcessEngine(demo_engine, threads=1)
    try:
        one_token = [GenerateRequest("hello there", 1, True, {"end_id": -1})] * 3
        assert engine.decode_rate(one_token) == 0.0        # prefill makes the only token
        assert engine.decode_rate([GenerateRequest("hello there", 6, True, {"end_id": -1})] * 3) > 0
        assert not engine.engine.has_unfinished()
    finally:
        engine.close()


def _swept(sweep: Sweep, mode: str, attainment: dict) -> tuple[list[Summary], list[str], list]:
    """Run ``sweep`` with ``attainment[rate]`` as each point's result: (points, what it said,
    (index, rate) of every measure call)."""
    said, calls = [], []

    def measure(i: int, rate: float) -> Summary:
        calls.append((i, rate))
        return _row(rate, attainment[rate], mode)
    return sweep.run(mode, measure, said.append), said, calls


def test_stepped_sweep_goes_on_until_each_mode_misses_its_slo():
    sweep = Sweep.stepped(4, 30)
    assert sweep.rates == (4, 8, 12, 16, 20, 24, 28) and sweep.until_miss
    # disaggregated meets it up to 12 (0.95 >= 0.9), misses at 16; 20 would pass again
    disagg, said, calls = _swept(sweep, "disaggregated", {4: 1, 8: 1, 12: 0.95, 16: 0.5, 20: 1})
    assert [p.rate for p in disagg] == [4, 8, 12, 16] and calls[-1] == (3, 16)
    assert said[0] == "disaggregated: rate 4 req/s (point 1 of at most 7)"
    assert said[-1].startswith("disaggregated missed its SLO at 16 req/s (50% attainment)")
    aggregated, _, _ = _swept(sweep, "aggregated", {4: 1, 8: 0.89})
    assert [p.rate for p in aggregated] == [4, 8]
    never, said, _ = _swept(sweep, "aggregated", dict.fromkeys(sweep.rates, 1.0))
    assert [p.rate for p in never] == list(sweep.rates)
    assert "met its SLO up to the cap of 28 req/s" in said[-1]

    lines = verdicts(disagg + aggregated, ["disaggregated", "aggregated"], sweep)
    assert lines == ["- **disaggregated** missed the SLO first at 16 req/s (50% attainment); "
                     "its sweep stopped there.",
                     "- **aggregated** missed the SLO first at 8 req/s (89% attainment); its "
                     "sweep stopped there."]
    (floor,) = verdicts(never, ["aggregated"], sweep)
    assert "every swept rate, up to 28 req/s: its goodput is a floor" in floor
    assert goodput(disagg) == 12 and goodput(aggregated) == 4


def test_explicit_rates_are_all_swept_and_the_flags_are_checked():
    sweep = Sweep.explicit([2, 8, 4])
    points, said, calls = _swept(sweep, "aggregated", {2: 1, 8: 0, 4: 1})
    assert calls == [(0, 2), (1, 8), (2, 4)] and len(said) == 3
    (line,) = verdicts(points, ["aggregated"], sweep)
    assert line == ("- **aggregated** missed the SLO first at 8 req/s (0% attainment); it "
                    "missed at 1 of its 3 swept rates.")

    default = serve_cli._sweep(_parser().parse_args(["serve"]))
    assert default.until_miss and default.rates[:2] == (4, 8) and default.rates[-1] == 64
    assert serve_cli._sweep(_parser().parse_args(["serve", "--rate-step", "0.5", "--max-rate",
                                                  "1.2"])).rates == (0.5, 1.0)
    assert serve_cli._sweep(_parser().parse_args(["serve", "--rates", "3,1"])).rates == (3, 1)
    with pytest.raises(UserError, match="leave out --rate-step"):
        serve_cli._sweep(_parser().parse_args(["serve", "--rates", "3", "--max-rate", "9"]))
    for step, cap in ((0, 4), (4, 2), (-1, 4)):
        with pytest.raises(UserError, match="need 0 < step <= max rate"):
            Sweep.stepped(step, cap)


def test_a_missed_slo_stops_each_modes_sweep_at_its_first_rate(demo_engine, tmp_path, capsys):
    """A real run with an SLO nothing can meet (1 microsecond to first token): both modes
    stop after the first rate of a 2, 4, 6 sweep, and the report says where and why."""
    args = _parser().parse_args([
        "serve", "--engine", str(demo_engine), "--rate-step", "2", "--max-rate", "6",
        "--duration", "1", "--serial-requests", "1", "--burst-requests", "2",
        "--prompt-tokens", "8", "--output-tokens", "4", "--slo-ttft-ms", "0.001",
        "--work-dir", str(tmp_path / "work"), "--img-dir", str(tmp_path / "img"),
        "--json", str(tmp_path / "serve.json")])
    assert args.func(args) == 0
    out, err = capsys.readouterr()

    rows = json.loads((tmp_path / "serve.json").read_text())["summaries"]
    modes = ("disaggregated", "aggregated")
    assert [(r["mode"], r["rate"]) for r in rows if r["mode"] in modes] == [
        (m, r) for m in modes for r in (0, 2.0, math.inf)]
    assert all(r["failed"] == 0 and r["attainment"] == 0 for r in rows), rows
    for mode in modes:
        assert f"{mode} missed its SLO at 2 req/s (0% attainment): its sweep stops here" in err
        assert (f"- **{mode}** missed the SLO first at 2 req/s (0% attainment); its sweep "
                f"stopped there.") in out
    assert "Rates: 2, 4, 6 req/s, each mode until it misses the SLO" in out
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == [
        "serve_latency.png", "serve_throughput.png"]

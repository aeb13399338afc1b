"""`bench soak`'s own logic, without a server: hung-request accounting, the RSS flatness
verdict, crash lines in logs, reading genai-perf's and locust's outputs, the verdict, and
the refusal to run without genai-perf."""

from __future__ import annotations

import json
import subprocess

import pytest

from triton_disagg.bench.soak_report import RSS_MIN_WINDOW, StrategyResult, markdown
from triton_disagg.bench.soak_server import Crashes, config_for, scan_logs
from triton_disagg.bench.soak_tools import find_genai_perf, locust_tallies, read_profile_export
from triton_disagg.bench.soak_watch import (Record, RequestLog, RssRow, Tally, deadline_seconds,
                                            rss_rows, token_count_problem)
from triton_disagg.errors import UserError


def _ended(log: RequestLog, kind: str, max_tokens: int, start: float, took: float,
           outcome: str = "ok") -> Record:
    record = log.begin(kind, max_tokens)
    record.start, record.end, record.outcome = start, start + took, outcome
    return record


def test_a_request_is_hung_when_it_ends_or_stays_open_past_its_deadline():
    assert deadline_seconds(100) == 30 + 0.5 * 100
    log = RequestLog()
    _ended(log, "k", 100, 0.0, 79.0)                       # in time
    _ended(log, "k", 100, 0.0, 81.0)                       # ended, but late: hung
    _ended(log, "k", 10, 0.0, 1.0, "expected_error")
    _ended(log, "k", 10, 0.0, 1.0, "unexpected_error")
    still = log.begin("k", 10)
    still.start = 0.0                                      # deadline 35 s after 0
    t = log.tally(now=20.0)["k"]
    assert (t.sent, t.ok, t.hung, t.expected_error, t.unexpected_error, t.open) == \
        (5, 1, 1, 1, 1, 1)
    t = log.tally(now=36.0)["k"]
    assert (t.hung, t.open) == (2, 0)
    assert any("hung after 81.0 s" in e for e in t.examples)
    assert log.open_deadline() == 35.0


def test_a_reply_with_tokens_missing_is_counted_apart():
    assert token_count_problem(8, 24, 24) is None
    assert token_count_problem(3, None, 3) is None              # no count: the responses
    assert token_count_problem(20, 20, 24) == "asked for 24 tokens, got 20"
    assert token_count_problem(25, 24, 24) == "25 text responses for 24 tokens"
    log = RequestLog()
    log.finish(log.begin("k", 24), "unexpected_error", "asked for 24 tokens, got 20",
               miscounted=True)
    log.finish(log.begin("k", 24), "ok")
    t = log.tally()["k"]
    assert (t.sent, t.ok, t.unexpected_error, t.miscounted) == (2, 1, 1, 1)


def test_rss_flatness_over_the_window_only():
    samples = {"generation_0_0": [(t, 7, kib) for t, kib in
                                  [(0, 50_000), (10, 100_000), (20, 100_000), (30, 105_000)]],
               "orchestrator_0_0": [(t, 8, 100_000 + 2_000 * t) for t in (0, 10, 20, 30)],
               "context_0_0": [(0, 9, 100_000), (20, 10, 100_000), (30, 10, 100_000)]}
    rows = {r.process: r for r in rss_rows(samples, since=10, until=30)}
    gen = rows["generation_0_0"]
    assert (gen.samples, round(gen.first_mib), round(gen.max_mib)) == (3, 98, 103)
    assert gen.flat and gen.spread == pytest.approx(0.05)  # warm-up growth before the window
    assert not rows["orchestrator_0_0"].flat                # 120k -> 160k: 33 %
    assert rows["context_0_0"].flat                         # pid changed before the window
    restarted = {r.process: r for r in rss_rows(samples, 0, 30)}["context_0_0"]
    assert restarted.restarted and not restarted.flat


def test_crash_lines_and_stub_deaths_are_counted(tmp_path):
    log, kept, serve = tmp_path / "tritonserver.log", tmp_path / "tritonserver.1.log", \
        tmp_path / "serve.log"
    log.write_text('I1203 12:00:00.1 1 server.cc:1] "fine"\n'
                   'E1203 12:00:01.2 1 pb_stub.cc:930] "KeyError: <Future at 0x7f44>"\n'
                   'E1203 12:00:02.2 1 pb_stub.cc:930] "KeyError: <Future at 0x7f55>"\n'
                   'E1203 12:00:03.2 1 x.cc:1] "CUDA driver version is insufficient"\n')
    kept.write_text("Fatal Python error: Segmentation fault\n"
                    "Current thread 0x00007f (most recent call first):\n"
                    "Segmentation fault (core dumped)\n")
    serve.write_text("triton-disagg serve all: the stub process of generation_0_1 (pid 9) died; "
                     "Triton cannot restart it\ntritonserver exited with code -11:\n")
    c = scan_logs([log, kept], serve)
    assert (c.fatal, c.segfault, c.stub_deaths, c.server_exits) == (1, 2, 1, 1)
    assert c.total == 5 and any("generation_0_1" in e for e in c.evidence)
    assert list(c.error_lines.values()) == [2]               # same message, CPU noise left out
    assert scan_logs([log], None).total == 0


def test_genai_perf_export_counts_missing_and_late_responses(tmp_path):
    s = 1_000_000_000
    limit = int(deadline_seconds(24) * s)
    export = tmp_path / "profile_export.json"
    export.write_text(json.dumps({"experiments": [{"requests": [
        {"timestamp": str(5 * s), "response_timestamps": [5 * s + 10, 6 * s]},
        {"timestamp": str(5 * s), "response_timestamps": []},
        {"timestamp": str(5 * s), "response_timestamps": [5 * s + limit + 1]}]}]}))
    t = Tally()
    read_profile_export(export, t, 24)
    assert (t.sent, t.ok, t.unexpected_error, t.hung) == (3, 1, 1, 1)


def _locust_csv(path, rows):
    head = "Type,Name,Request Count,Failure Count,Max Response Time\n"
    path.write_text(head + "".join(",".join(map(str, r)) + "\n" for r in rows))


def test_locust_stats_become_tallies(tmp_path):
    _locust_csv(tmp_path / "run_stats.csv", [
        ("grpc_stream", "ttft", 10, 0, 50), ("grpc_stream", "e2e", 10, 1, 900),
        ("http_stream", "e2e", 8, 0, 99_000), ("", "Aggregated", 28, 1, 99_000)])
    (tmp_path / "run_failures.csv").write_text(
        "Method,Name,Error,Occurrences\ngrpc_stream,e2e,GenerateError('boom'),1\n")
    done = subprocess.Popen(["true"])
    out = locust_tallies(done, tmp_path, wait=10)
    grpc, http = out["locust grpc_stream"], out["locust http_stream"]
    assert (grpc.sent, grpc.ok, grpc.unexpected_error, grpc.hung) == (10, 9, 1, 0)
    assert "boom" in grpc.examples[0]
    assert (http.sent, http.ok, http.hung) == (8, 7, 1)      # 99 s > 30 + 0.5 * 64 s


def test_locust_without_stats_or_running_over_is_a_failure(tmp_path):
    assert locust_tallies(subprocess.Popen(["true"]), tmp_path, 10)["locust"].unexpected_error == 1
    slow = subprocess.Popen(["sleep", "30"], start_new_session=True)
    t = locust_tallies(slow, tmp_path, wait=0.2)["locust"]
    assert t.hung == 1 and slow.poll() is not None


def test_soak_refuses_to_run_without_genai_perf(tmp_path):
    with pytest.raises(UserError, match="scripts/install-genai-perf.sh"):
        find_genai_perf(tmp_path / "nowhere")
    with pytest.raises(UserError, match="scripts/install-genai-perf.sh"):
        find_genai_perf(tmp_path)                             # a directory without bin/genai-perf


def _result(**changes) -> StrategyResult:
    rows = [RssRow("generation_0_0", 10, 100, 101, 100, 101, False)]
    base = dict(strategy="host_memory", placement="2 generation instances", ready_seconds=5,
                load_seconds=600, drain_seconds=20, tallies={"a": Tally(sent=3, ok=3)},
                crashes=Crashes(), pools={"context_0_0": 0, "generation_0_0": 0},
                settle_seconds=1, rss=rows, rss_window=300)
    return StrategyResult(**{**base, **changes})


def test_verdict_fails_on_each_hard_criterion():
    assert _result().verdict == "PASS" and not _result().failures()
    assert "2 hung requests" in _result(tallies={"a": Tally(sent=2, hung=1, open=1)}).failures()
    assert "1 crashes" in _result(crashes=Crashes(segfault=1)).failures()
    assert any("3 KV blocks" in f for f in _result(pools={"generation_0_1": 3}).failures())
    assert any("no disagg_kv_blocks_used" in f for f in _result(pools={}).failures())
    assert "1 unexpected errors" in \
        _result(tallies={"a": Tally(sent=1, unexpected_error=1)}).failures()
    short = _result(tallies={"a": Tally(sent=2, ok=1, unexpected_error=1, miscounted=1)})
    assert "1 requests whose token count disagrees with num_output_tokens or max_tokens" in \
        short.failures()
    assert "| **all** | **2** | **1** | **0** | **1** | **1** | **0** |" in \
        markdown([short], 1, "triton-disagg bench soak")
    growing = [RssRow("orchestrator_0_0", 10, 100, 130, 100, 130, False)]
    assert any("orchestrator_0_0" in f for f in _result(rss=growing).failures())
    server = [RssRow("tritonserver", 10, 60, 70, 60, 70, False)]    # Triton's own: shown only
    assert _result(rss=server).verdict == "PASS"
    assert "(shown, not judged)" in markdown([_result(rss=server)], 10, "triton-disagg bench soak")
    short = _result(rss=growing, rss_window=RSS_MIN_WINDOW - 1)
    assert short.verdict == "PASS"                           # shown, not judged
    text = markdown([short, _result(strategy="direct_transfer")], 1, "triton-disagg bench soak")
    assert "| host_memory |" in text and "not judged" in text and "**no**" in text


def test_overlap_serves_direct_transfer_with_overlap_and_refuses_host_memory(tmp_path, capsys):
    from triton_disagg.cli import main
    from triton_disagg.config.disagg import parse_config

    (tmp_path / "engine.json").write_text("{}")
    raw, _ = config_for(tmp_path, "direct_transfer", 2, [0, 1], overlap=True)
    assert parse_config(raw).kv_cache.overlap_transfer
    assert not parse_config(config_for(tmp_path, "host_memory", 2, [0, 1])[0]) \
        .kv_cache.overlap_transfer
    assert main(["bench", "soak", "--overlap", "--strategies", "direct_transfer,host_memory",
                 "--genai-perf", str(tmp_path / "nowhere")]) == 2
    error = capsys.readouterr().err.strip()
    assert "--overlap needs --strategies direct_transfer: host_memory" in error
    assert "\n" not in error


def test_config_pins_only_with_a_core_per_instance(tmp_path):
    (tmp_path / "engine.json").write_text("{}")
    from triton_disagg.config.disagg import parse_config

    two, words = config_for(tmp_path, "direct_transfer", 2, [0, 1])
    assert "unpinned" in words and "cpus" not in two["generation_server"]
    three, words = config_for(tmp_path, "host_memory", 2, [0, 1, 2])
    assert three["generation_server"] == {"cpus": [1, 2], "instances": 2}
    for raw in (two, three):
        config = parse_config(raw)
        assert config.generation.instances == 2

"""`bench soak` fails when a client it was asked to run did not run or measured nothing:
a genai-perf run that exits non-zero or leaves no, an empty or an unreadable profile
export (the CI case: perf_analyzer wrote a 0-byte export, genai-perf exited 1 and the
soak's reader raised JSONDecodeError in the client's thread, which ended unseen), a
genai-perf loop none of whose runs measured a request, a client thread that raised or
never ended, and a locust run without e2e requests. No process is started: the runs'
artifacts are written here, and the tools' runner is replaced."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from triton_disagg.bench import soak_tools
from triton_disagg.bench.soak_report import StrategyResult
from triton_disagg.bench.soak_server import Crashes
from triton_disagg.bench.soak_tools import (NoRequestsMeasured, genai_perf_loop,
                                            judge_genai_perf_run, locust_tallies)
from triton_disagg.bench.soak_watch import ClientThread, RssRow, Tally

EXPORT_DIR = "ensemble-triton-tensorrtllm-concurrency4"
CI_LOG_TAIL = ("orjson.JSONDecodeError: Input is a zero-length, empty document: line 1 "
               "column 1 (char 0)\n"
               "[2026-12-06 21:46:42] ERROR    Input is a zero-length, empty          main.py:55\n"
               "                               document: line 1 column 1 (char 0)\n")


def _run(artifacts: Path, export: str | None, log: str = "genai-perf said nothing\n") -> Path:
    """A genai-perf run's folder as it leaves it: its log and (unless None) its export."""
    (artifacts / EXPORT_DIR).mkdir(parents=True, exist_ok=True)
    (artifacts / "genai-perf.log").write_text(log)
    if export is not None:
        (artifacts / EXPORT_DIR / "profile_export.json").write_text(export)
    return artifacts


def _export(requests: int) -> str:
    s = 1_000_000_000
    return json.dumps({"experiments": [{"requests": [
        {"timestamp": 5 * s, "response_timestamps": [5 * s + 10, 6 * s]}] * requests}]})


def _result(**changes) -> StrategyResult:
    base = dict(strategy="direct_transfer + overlap", placement="2 generation instances",
                ready_seconds=5, load_seconds=60, drain_seconds=20,
                tallies={"genai-perf": Tally(sent=3, ok=3)}, crashes=Crashes(),
                pools={"context_0_0": 0, "generation_0_0": 0}, settle_seconds=1,
                rss=[RssRow("generation_0_0", 10, 100, 101, 100, 101, False)], rss_window=300)
    return StrategyResult(**{**base, **changes})


def test_the_ci_run_with_an_empty_export_is_a_failed_run_with_its_log_tail(tmp_path):
    tally = Tally()
    run = _run(tmp_path / "run-1", export="", log=CI_LOG_TAIL)
    assert judge_genai_perf_run(1, 1, run, tally) == 0           # no JSONDecodeError raised
    assert (tally.sent, tally.unexpected_error) == (1, 1)
    why = tally.examples[0]
    assert why.startswith("run 1 exited 1; profile_export.json unreadable (JSONDecodeError")
    assert "zero-length, empty document: line 1 column 1 (char 0)" in why    # genai-perf's log
    assert str(run / "genai-perf.log") in why


@pytest.mark.parametrize("export, problem", [
    (None, "wrote no profile_export.json"),
    ("[]", "profile_export.json unreadable (ValueError: not a profile export: AttributeError"),
    ('{"experiments": [{"requests": [{"response_timestamps": [1]}]}]}',
     "profile_export.json unreadable (ValueError: not a profile export: KeyError: 'timestamp')"),
    (_export(0), "its profile export lists no request"),
])
def test_a_run_exiting_zero_without_requests_measured_is_a_failed_run(tmp_path, export, problem):
    tally = Tally()
    assert judge_genai_perf_run(2, 0, _run(tmp_path, export), tally) == 0
    assert (tally.sent, tally.ok, tally.unexpected_error) == (1, 0, 1)
    assert tally.examples[0].startswith(f"run 2 {problem}")
    assert tally.examples[0].endswith("ends: genai-perf said nothing")


def test_a_good_run_counts_its_requests_and_no_failure(tmp_path):
    tally = Tally()
    assert judge_genai_perf_run(1, 0, _run(tmp_path, _export(3)), tally) == 3
    assert (tally.sent, tally.ok, tally.unexpected_error, tally.examples) == (3, 3, 0, [])
    failed = Tally()                                  # measured, but genai-perf then failed
    assert judge_genai_perf_run(1, 1, _run(tmp_path, _export(3)), failed) == 3
    assert (failed.sent, failed.ok, failed.unexpected_error) == (4, 3, 1)


def _loop_with_runs(monkeypatch, tmp_path, export: str, rc: int) -> tuple[ClientThread, Tally]:
    """genai_perf_loop in a ClientThread, each run writing ``export`` and exiting ``rc``
    (one run: the soak's end is a second away)."""
    def run_genai_perf(gp, grpc: str, tokenizer: Path, artifacts: Path) -> int:
        _run(artifacts, export, CI_LOG_TAIL)
        return rc

    monkeypatch.setattr(soak_tools, "run_genai_perf", run_genai_perf)
    tally = Tally()
    thread = ClientThread("genai-perf", genai_perf_loop, None, "127.0.0.1:1", tmp_path,
                          time.monotonic() + 1, tmp_path / "genai-perf", tally, lambda m: None)
    thread.start()
    thread.join(timeout=10)
    return thread, tally


def test_a_genai_perf_loop_that_measured_nothing_fails_the_soak_naming_it(monkeypatch,
                                                                          tmp_path):
    thread, tally = _loop_with_runs(monkeypatch, tmp_path, export="", rc=1)  # run again once
    assert thread.failure().startswith("ended with NoRequestsMeasured: no genai-perf run "
                                       "measured a request (runs: 2) (at soak_tools.py:")
    result = _result(tallies={"genai-perf": tally}, client_failures={"genai-perf":
                                                                      thread.failure()})
    assert result.verdict == "FAIL"
    assert result.failures()[0].startswith("client genai-perf failed: ended with "
                                           "NoRequestsMeasured")
    assert "1 unexpected errors" in result.failures()
    with pytest.raises(NoRequestsMeasured):
        genai_perf_loop(None, "", tmp_path, time.monotonic() + 1, tmp_path / "again", Tally(),
                        lambda m: None)
    thread, tally = _loop_with_runs(monkeypatch, tmp_path / "good", export=_export(2), rc=0)
    assert thread.failure() is None and (tally.sent, tally.ok) == (2, 2)


def test_an_empty_export_is_run_again_once_past_the_end_and_not_counted(monkeypatch, tmp_path):
    """perf_analyzer wrote a 0-byte export in two CI runs (it exits 0; genai-perf then fails
    to parse it): such a run is run again once, even when the soak's time is up, and only
    the next run counts. Another kind of failed run is not run again."""
    exports, said = iter(["", _export(3)]), []

    def run_genai_perf(gp, grpc: str, tokenizer: Path, artifacts: Path) -> int:
        export = next(exports)
        _run(artifacts, export, CI_LOG_TAIL)
        return 0 if export else 1

    monkeypatch.setattr(soak_tools, "run_genai_perf", run_genai_perf)
    tally = Tally()
    genai_perf_loop(None, "", tmp_path, time.monotonic() + 1, tmp_path / "gp", tally,
                    said.append)
    assert (tally.sent, tally.ok, tally.unexpected_error) == (3, 3, 0)
    assert said[0].startswith("genai-perf run 1: exit 1, perf_analyzer wrote an empty profile "
                              "export")
    assert said[1] == "genai-perf run 2: exit 0, 3 requests measured"
    exports, tally = iter(["[]"]), Tally()                  # unreadable, not empty: counted
    with pytest.raises(NoRequestsMeasured, match=r"\(runs: 1\)"):
        genai_perf_loop(None, "", tmp_path, time.monotonic() + 1, tmp_path / "gp2", tally,
                        said.append)
    assert tally.unexpected_error == 1


def test_a_client_thread_that_raised_or_never_ended_fails_the_soak():
    def reads_an_empty_export():
        json.loads("")

    dead = ClientThread("genai-perf", reads_an_empty_export)
    dead.start()
    dead.join()
    assert dead.failure().startswith("ended with JSONDecodeError: Expecting value: line 1 "
                                     "column 1 (char 0) (at ")
    release = threading.Event()
    stuck = ClientThread("cancel 0", release.wait)
    stuck.start()
    assert stuck.failure() == "still running when the soak stopped waiting"
    release.set()
    stuck.join()
    assert stuck.failure() is None
    assert ClientThread("bad input", print).failure() == "never started"
    result = _result(client_failures={"genai-perf": dead.failure()})
    assert result.verdict == "FAIL"
    assert result.failures() == [f"client genai-perf failed: {dead.failure()}"]
    assert _result().verdict == "PASS"


class _Ended:
    """What locust_tallies reads of a locust process that has ended."""
    returncode = 0

    def wait(self, timeout: float) -> int:
        return self.returncode


def test_a_locust_run_without_e2e_requests_is_a_failure(tmp_path):
    (tmp_path / "run_stats.csv").write_text(
        "Type,Name,Request Count,Failure Count,Max Response Time\n"
        "grpc_stream,e2e,0,0,0\nhttp_stream,e2e,0,0,0\n,Aggregated,0,0,0\n")
    (tmp_path / "locust.log").write_text("no users spawned\n")
    t = locust_tallies(_Ended(), tmp_path, wait=1)["locust"]
    assert (t.sent, t.unexpected_error) == (1, 1)
    assert t.examples == [f"measured no e2e request (exit 0; {tmp_path / 'locust.log'} ends: "
                          f"no users spawned)"]

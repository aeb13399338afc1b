"""How often ``serve`` restarts a server whose stub died (launch/serve_cli.py): at most
``MAX_RESTARTS`` within ``RESTART_WINDOW_SECONDS``, so a crash loop still ends, but rare
deaths spread over a long life never add up to serve giving up for good (issue 27
re-review: the count was per serve run, so the sixth stub death in a month stopped it)."""

from __future__ import annotations

import time

from launch.restarts import MAX_RESTARTS, RESTART_WINDOW_SECONDS, RestartBudget, keep_log


def test_a_crash_loop_runs_out_of_restarts():
    now = [0.0]
    budget = RestartBudget(clock=lambda: now[0])
    for _ in range(MAX_RESTARTS):
        assert budget.spend()
        now[0] += 1.0
    assert not budget.spend()


def test_deaths_spread_over_a_long_life_are_each_restarted():
    now = [0.0]
    budget = RestartBudget(clock=lambda: now[0])
    for _ in range(10 * MAX_RESTARTS):
        assert budget.spend()
        now[0] += RESTART_WINDOW_SECONDS / MAX_RESTARTS + 1.0


def test_only_the_last_restarts_logs_are_kept(tmp_path):
    """Review item 6: with the budget a window, restarts never stop counting; the stopped
    servers' logs (tritonserver.N.log) stay at ``MAX_RESTARTS``, the newest."""
    restarts = 3 * MAX_RESTARTS
    for restart in range(1, restarts + 1):
        (tmp_path / "tritonserver.log").write_text(f"server {restart - 1}")
        keep_log(tmp_path, restart)
    kept = sorted(tmp_path.iterdir(), key=lambda p: int(p.name.split(".")[1]))
    assert [p.name for p in kept] == [f"tritonserver.{n}.log" for n in
                                      range(restarts - MAX_RESTARTS + 1, restarts + 1)]
    assert kept[-1].read_text() == f"server {restarts - 1}"


def test_an_earlier_runs_logs_are_pruned_and_a_missing_log_is_no_error(tmp_path):
    """A new serve counts restarts from 1 again: the kept logs of an earlier run in the same
    work directory (older) go first; a start that failed before tritonserver wrote a log
    leaves nothing to keep, and that is not an error (it was a traceback before)."""
    import os
    for n in range(1, 10):                                   # an earlier run's, an hour ago
        old = tmp_path / f"tritonserver.{n}.log"
        old.write_text("earlier run")
        os.utime(old, (time.time() - 3600, time.time() - 3600))
    keep_log(tmp_path, 1)                                    # no tritonserver.log: no error
    (tmp_path / "tritonserver.log").write_text("this run")
    keep_log(tmp_path, 2)
    kept = {int(p.name.split(".")[1]) for p in tmp_path.glob("tritonserver.*.log")}
    assert kept == {2, *range(10 - MAX_RESTARTS + 1, 10)}    # this run's, then the newest
    assert (tmp_path / "tritonserver.2.log").read_text() == "this run"

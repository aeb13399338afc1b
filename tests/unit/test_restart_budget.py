"""How often ``serve`` restarts a server whose stub died (launch/serve_cli.py): at most
``MAX_RESTARTS`` within ``RESTART_WINDOW_SECONDS``, so a crash loop still ends, but rare
deaths spread over a long life never add up to serve giving up for good (issue 27
re-review: the count was per serve run, so the sixth stub death in a month stopped it)."""

from __future__ import annotations

from launch.serve_cli import MAX_RESTARTS, RESTART_WINDOW_SECONDS, RestartBudget


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

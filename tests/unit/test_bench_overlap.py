"""`bench overlap` without a server: the rounds taking turns and keeping the best, the
greedy-text check between the deployments, the table, the link mode's configs and
commands, and its refusal without root."""

from __future__ import annotations

import argparse
import os

import pytest

from triton_disagg.bench import overlap, overlap_link
from triton_disagg.bench.second_token import TimedReply
from triton_disagg.errors import UserError


def _args(**kw) -> argparse.Namespace:
    base = dict(requests=2, rounds=2, prompt_tokens="64", cpus="0,1", link_mbit=None,
                runtime="torch",
                engine=None, work_dir=None, output=None)
    return argparse.Namespace(**{**base, **kw})


class FakeClient:
    """Replies whose times grow with each call (round 1 slowest) and whose "with" text can
    differ from "without"'s; records every call."""

    def __init__(self, wrong_text_on: int | None = None):
        self.calls: list[tuple[str, int, int]] = []
        self.wrong_text_on = wrong_text_on

    def __call__(self, url: str, prompts, max_tokens: int) -> list[TimedReply]:
        self.calls.append((url, len(prompts), max_tokens))
        k = len(self.calls)
        wrong = url == "with" and k == self.wrong_text_on
        second = (0.5 if url == "with" else 1.0) / k
        return [TimedReply(0.1, 0.1 + second, f"{p[:3]}{'!' if wrong else ''}") for p in prompts]


def test_measure_pairs_each_request_and_keeps_each_deployments_best_round():
    client = FakeClient()
    prompts = {64: ["warm", "a", "b"]}
    rows = overlap.measure(_args(), prompts, {"without": "without", "with": "with"}, client,
                           lambda _: None, link_mbit=200.0)
    # warm-up of TEXT_TOKENS each, then per round each request to one deployment then the other
    assert client.calls == [("without", 1, overlap.TEXT_TOKENS), ("with", 1, overlap.TEXT_TOKENS),
                            *[("without", 1, 2), ("with", 1, 2)] * 4]
    (row,) = rows
    assert row.link_mbit == 200.0 and row.tokens == 64

    def second(base: float, calls: tuple[int, int]) -> float:     # a round's median
        return 0.1 + (base / calls[0] + base / calls[1]) / 2

    assert row.without.second == pytest.approx(second(1.0, (7, 9)))   # round 2, faster
    assert row.with_.second == pytest.approx(second(0.5, (8, 10)))
    assert row.second_ratio == pytest.approx(row.with_.second / row.without.second)
    assert row.hidden == pytest.approx(1 - (row.with_.second - 0.1) / (row.without.second - 0.1))
    assert row.paired == pytest.approx((second(0.5, (4, 6)) / second(1.0, (3, 5)),
                                        second(0.5, (8, 10)) / second(1.0, (7, 9))))


@pytest.mark.parametrize("call", [2, 4])     # the warm-up's text, then a timed request's
def test_a_different_greedy_text_with_overlap_fails_the_bench(call):
    with pytest.raises(UserError, match="64-token prompt's greedy text differs with overlap"):
        overlap.measure(_args(), {64: ["warm", "a", "b"]}, {"without": "without", "with": "with"},
                        FakeClient(wrong_text_on=call), lambda _: None)


def test_markdown_names_the_link_of_each_row():
    t = overlap.Timing(0.1, 0.3)
    rows = [overlap.Row(2000, t, overlap.Timing(0.1, 0.2), paired=(0.7, 0.6, 0.9)),
            overlap.Row(2000, t, overlap.Timing(0.1, 0.2), link_mbit=200.0, paired=(0.5,))]
    text = overlap.markdown(rows, _args(link_mbit="200"))
    assert ("| one host | 2,000 | 100 / 100 ms | 300 ms | 200 ms | 0.667 | 0.70 / 0.60 / 0.90 "
            "(**0.700**) | 200.0 ms | 100.0 ms | 50% |") in text
    assert "| 200 Mbit/s | 2,000 |" in text and "shaped to the link rate" in text
    assert "--link-mbit 200`" in text                      # the command that reruns it


def test_the_verdict_holds_at_a_paired_ratio_of_0_8_and_misses_above():
    t = overlap.Timing(0.1, 1.0)
    rows = [overlap.Row(2000, t, overlap.Timing(0.1, 0.5), link_mbit=200.0, paired=(0.8, 0.9, 0.7)),
            overlap.Row(8000, t, overlap.Timing(0.1, 0.5), paired=(0.81,))]
    assert overlap.verdict(rows).endswith(": holds at 200 Mbit/s, 2,000 tokens (0.800); "
                                          "MISSES at one host, 8,000 tokens (0.810).")


class FakeHosts:
    def address(self, host: str) -> str:
        return {"context": "10.0.0.1", "generation": "10.0.0.2"}[host]


def test_each_deployment_names_the_two_hosts_on_its_own_ports(tmp_path):
    """The configs load as written (the engine is on no host here)."""
    from triton_disagg.config.disagg import load_config

    placed = {"context_server": {"cpus": [0]}, "generation_server": {"cpus": [1]},
              "scheduler_server": {"cpus": [0]}}
    urls = []
    for mode, offset in (("without", 0), ("with", overlap_link.MODE_OFFSET)):
        path = tmp_path / f"{mode}.yaml"
        path.write_text(overlap_link.config_text(tmp_path / "engine", FakeHosts(), offset,
                                                 placed, "160MB", 300.0, "torch"))
        config = load_config(path, engine_here=False)
        urls.append((config.server("context").urls, config.server("generation").urls))
        assert config.generation.stall_seconds == 300.0 and config.runtime == "torch"
    assert urls[0] == (("10.0.0.1:9001",), ("10.0.0.2:9002",))
    assert urls[1] == (("10.0.0.1:10001",), ("10.0.0.2:10002",))


def test_only_the_with_deployment_is_served_with_overlap(tmp_path):
    ports = set()
    for mode, offset in (("without", 0), ("with", overlap_link.MODE_OFFSET)):
        for role in ("context", "generation", "scheduler"):
            cmd = overlap_link.serve_command(FakeHosts(), role, tmp_path / "c.yaml", offset,
                                             mode == "with", tmp_path / role)
            assert ("--overlap_kv_transfer" in cmd) == (mode == "with")
            assert cmd[cmd.index("--host") + 1] == FakeHosts().address(overlap_link.HOST_OF[role])
            host = overlap_link.HOST_OF[role]
            for flag in ("--grpc-port", "--metrics-port", "--front-port", "--http-port"):
                if flag in cmd:
                    ports.add((host, cmd[cmd.index(flag) + 1]))
    # 2 deployments: context 3 ports each; generation 3 + scheduler 4 each, none shared
    assert len(ports) == 2 * 3 + 2 * 7


def test_the_link_mode_refuses_without_root_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)       # as a user who is not root
    with pytest.raises(UserError) as exc:
        overlap.run(_args(link_mbit="200", work_dir=tmp_path))
    assert str(exc.value).startswith("bench overlap --link-mbit: ")
    assert "root" in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "engines").exists()        # refused before building anything

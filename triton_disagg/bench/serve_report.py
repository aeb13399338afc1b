"""`bench serve` results as markdown (for docs/benchmarks.md) and PNG plots (matplotlib, Agg).

Rows come from :class:`serve_stats.Summary`; rate 0 is shown as "serial" (one
request at a time), ``inf`` as "burst" (all at once). Invariant: the verdict
lines state the target, the measured value and whether it holds, and say where
each mode first missed its SLO or that its goodput is only a floor
(:func:`serve_stats.verdicts`), so the section reads correctly on its own
whatever the numbers are.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from triton_disagg.bench.serve_stats import (GOODPUT_ATTAINMENT, SLO, Percentiles, Summary,
                                             Sweep, goodput, verdicts)
from triton_disagg.config.roles import Mode

TTFT_ADDED_MAX = 0.010          # overhead target: at most 10 ms added TTFT at p50
# and at most this much output throughput lost at saturation: per stream_interval,
# a streamed response per token costs the server a response each; others as at 4
THROUGHPUT_LOSS_MAX = {1: 0.30, 4: 0.10}


def throughput_loss_max(stream_interval: int) -> float:
    return THROUGHPUT_LOSS_MAX.get(stream_interval, THROUGHPUT_LOSS_MAX[4])
ACCEPT_TTFT = 0.200             # deployment guide: TTFT under 200 ms (p90 here) ...
ACCEPT_TOKENS = 1000.0          # ... and over 1000 output tokens/s aggregate
IN_PROCESS_CONTEXT = "in-process, context's cores"   # the serial set, prefill on the split's
BEST_OF = 3                     # serial sets, bursts and the decode ceiling: best of this many


@dataclass(frozen=True)
class Round:
    """One paired round of a mode: the engine in-process, then the server, on the same
    requests, back to back (seconds apart: the machine's drift cancels in the ratio)."""

    base_ttft: float             # in-process serial TTFT p50, seconds
    ttft: float                  # the server's
    base_tokens: float           # in-process burst output tokens/s
    tokens: float                # the server's

    @classmethod
    def of(cls, base_serial: Summary, serial: Summary, base_burst: Summary,
           burst: Summary) -> "Round":
        return cls(base_serial.ttft.p50, serial.ttft.p50, base_burst.token_throughput,
                   burst.token_throughput)

    @property
    def added(self) -> float:
        return self.ttft - self.base_ttft

    @property
    def lost(self) -> float:
        return 1 - self.tokens / self.base_tokens


def median_round(rounds: Sequence[Round], key) -> Round:
    """The round whose ``key`` is the median (the lower one of an even count)."""
    ordered = sorted(rounds, key=key)
    return ordered[(len(ordered) - 1) // 2]


@dataclass(frozen=True)
class SplitBaseline:
    """The engine in-process on the disaggregated split's cores (``bench serve``'s
    :func:`split_baseline`; the serial row on the context's cores is a Summary of mode
    :data:`IN_PROCESS_CONTEXT`)."""

    context_cores: tuple[int, ...]
    generation_cores: tuple[int, ...]
    decode_ceiling: float        # output tok/s of decode steps alone on generation's cores


@dataclass(frozen=True)
class Setup:
    engine: str
    cores: tuple[int, ...]
    prompt_tokens: str
    output_tokens: str
    slo: SLO
    sweep: Sweep
    seconds: float               # wall time of the whole run
    stream_interval: int = 1     # generation_server.stream_interval of both modes
    front: tuple[int, ...] = ()  # --front-cpus: the front end's and client's own cores


def _rate(rate: float, unit: str = "") -> str:
    return "serial" if rate == 0 else "burst" if math.isinf(rate) else f"{rate:g}{unit}"


def _ms(p: Percentiles | None) -> str:
    return "–" if p is None else f"{p.p50 * 1e3:.1f} / {p.p90 * 1e3:.1f} / {p.p99 * 1e3:.1f}"


def sweep_table(summaries: Sequence[Summary]) -> str:
    lines = ["| mode | rate (req/s) | done / sent | req/s | output tok/s | TTFT p50/p90/p99 (ms) "
             "| TPOT p50/p90/p99 (ms) | ITL p50/p90/p99 (ms) | SLO attainment | client cores |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        cores = "–" if s.client_cores is None else f"{s.client_cores:.2f}"
        lines.append(f"| {s.mode} | {_rate(s.rate)} | {s.sent - s.failed} / {s.sent} "
                     f"| {s.request_throughput:.2f} | {s.token_throughput:.0f} | {_ms(s.ttft)} "
                     f"| {_ms(s.tpot)} | {_ms(s.itl)} | {s.attainment:.0%} | {cores} |")
    return "\n".join(lines)


def _find(summaries: Sequence[Summary], mode: str, rate: float) -> Summary | None:
    return next((s for s in summaries if s.mode == mode and s.rate == rate), None)


def overhead_lines(summaries: Sequence[Summary], modes: Sequence[str], stream_interval: int,
                   rounds: dict[str, Sequence[Round]],
                   split: SplitBaseline | None = None) -> list[str]:
    """Per mode, the round with the median TTFT added and the one with the median
    throughput lost, against the targets above."""
    out = []
    lost_max = throughput_loss_max(stream_interval)
    for mode in modes:
        if not rounds.get(mode):
            continue
        t = median_round(rounds[mode], lambda r: r.added)
        b = median_round(rounds[mode], lambda r: r.lost)
        out.append(
            f"- **{mode}** (median of {len(rounds[mode])} paired rounds): TTFT p50 "
            f"{t.ttft * 1e3:.1f} ms vs {t.base_ttft * 1e3:.1f} ms in-process, {t.added * 1e3:+.1f} ms "
            f"({'holds' if t.added <= TTFT_ADDED_MAX else 'misses'} the <= "
            f"{TTFT_ADDED_MAX * 1e3:.0f} ms target); saturation {b.tokens:.0f} vs "
            f"{b.base_tokens:.0f} output tok/s, {b.lost:.0%} lost "
            f"({'holds' if b.lost <= lost_max else 'misses'} the <= {lost_max:.0%} target); "
            f"all rounds: " + ", ".join(f"{r.added * 1e3:+.1f} ms / {r.lost:.0%}"
                                        for r in rounds[mode]) + ".")
        serial = _find(summaries, mode, 0)
        if mode == Mode.DISAGGREGATED and split is not None and serial is not None:
            out += split_lines(split, _find(summaries, IN_PROCESS_CONTEXT, 0), serial, b,
                               (1 - lost_max) * b.base_tokens)
    return out or ["No paired rounds in this run."]


def split_lines(split: SplitBaseline, context_serial: Summary | None, serial: Summary,
                burst: Round, target: float) -> list[str]:
    """What the split alone costs, against what the serving path adds to it."""
    out = []
    cores = ",".join(map(str, split.context_cores))
    if context_serial is not None and context_serial.ttft is not None:
        out.append(
            f"  - the split: prefilled in-process on the context's core(s) {cores}, TTFT p50 "
            f"is {context_serial.ttft.p50 * 1e3:.1f} ms, so serving adds "
            f"{(serial.ttft.p50 - context_serial.ttft.p50) * 1e3:+.1f} ms to that.")
    reach = ("above the target's {:.0f} (the decode side alone does not rule it out; the "
             "context's cores hold the prefill and the front end)" if split.decode_ceiling >= target
             else "below the target's {:.0f}: no server with this split can meet it on these "
             "cores").format(target)
    out.append(
        f"  - the split: the engine's decode steps alone on generation's core(s) "
        f"{','.join(map(str, split.generation_cores))} (no prefill, tokenizing or serving; "
        f"best of {BEST_OF} bursts) make {split.decode_ceiling:.0f} output tok/s, {reach}; "
        f"disaggregated serving streamed {burst.tokens / split.decode_ceiling:.0%} of that "
        f"ceiling (the median round).")
    return out


def acceptance_lines(summaries: Sequence[Summary], modes: Sequence[str]) -> list[str]:
    out = []
    for mode in modes:
        rows = [s for s in summaries if s.mode == mode and s.ttft is not None]
        ok = [s for s in rows if s.ttft.p90 < ACCEPT_TTFT and s.token_throughput > ACCEPT_TOKENS]
        best = max(rows, key=lambda s: s.token_throughput, default=None)
        if ok:
            where = ", ".join(f"{_rate(s.rate, ' req/s')} ({s.token_throughput:.0f} tok/s, TTFT p90 "
                              f"{s.ttft.p90 * 1e3:.0f} ms)" for s in ok)
            out.append(f"- **{mode}**: holds at {where}.")
        elif best is not None:
            out.append(f"- **{mode}**: holds nowhere; the highest throughput was "
                       f"{best.token_throughput:.0f} output tok/s at {_rate(best.rate, ' req/s')} "
                       f"(TTFT p90 {best.ttft.p90 * 1e3:.0f} ms).")
    return out


def process_cpu_table(times: dict[str, tuple[float, list]], cores: int) -> str:
    """``times``: mode -> (burst seconds, ``(process, CPU seconds)`` rows)."""
    lines = ["| mode | process | CPU (s) | share of the cores |", "|---|---|---|---|"]
    for mode, (seconds, rows) in times.items():
        lines += [f"| {mode} | {name} | {cpu:.2f} | {cpu / (seconds * cores):.0%} |"
                  for name, cpu in rows]
    return "\n".join(lines)


def plot(summaries: Sequence[Summary], modes: Sequence[str], slo: SLO, img_dir: Path) -> list[Path]:
    """Two PNGs: latency (TTFT, TPOT) and throughput/attainment against the request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    swept = {m: sorted((s for s in summaries if s.mode == m and 0 < s.rate < math.inf),
                       key=lambda s: s.rate) for m in modes}
    paths = []
    # file -> panels of (y label, value of a summary, percentiles?, reference line)
    panels = {
        "serve_latency.png": [("TTFT (ms)", lambda s: s.ttft, True, slo.ttft * 1e3),
                              ("time per output token (ms)", lambda s: s.tpot, True,
                               slo.tpot * 1e3)],
        "serve_throughput.png": [("output tokens/s", lambda s: s.token_throughput, False, None),
                                 ("SLO attainment", lambda s: s.attainment, False,
                                  GOODPUT_ATTAINMENT)],
    }
    for name, specs in panels.items():
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for ax, (label, get, percentiles, line) in zip(axes, specs, strict=True):
            for color, (mode, rows) in enumerate(swept.items()):
                rates = [s.rate for s in rows]
                if percentiles:
                    for pct, style in (("p50", "-o"), ("p90", "--x")):
                        ax.plot(rates, [getattr(get(s), pct) * 1e3 if get(s) else math.nan
                                        for s in rows], style, color=f"C{color}",
                                label=f"{mode} {pct}")
                else:
                    ax.plot(rates, [get(s) for s in rows], "-o", color=f"C{color}", label=mode)
            if line is not None:
                ax.axhline(line, color="grey", linestyle=":", label="SLO")
            if percentiles:
                ax.set_yscale("log")      # queueing makes the overloaded rates 10-100x slower
            ax.set_xlabel("request rate (req/s, Poisson)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(img_dir / name, dpi=110)
        plt.close(fig)
        paths.append(img_dir / name)
    return paths


def markdown(setup: Setup, summaries: Sequence[Summary], modes: Sequence[str],
             images: Sequence[Path], doc_dir: Path, times: dict[str, tuple[float, list]],
             rounds: dict[str, Sequence[Round]], split: SplitBaseline | None = None) -> str:
    good = {m: goodput([s for s in summaries if s.mode == m]) for m in modes}
    cores = ",".join(str(c) for c in setup.cores)
    parts = [
        f"`triton-disagg bench serve`: engine `{setup.engine}`, cores {cores} (disaggregated: "
        f"context on the first half, generation on the second; aggregated: generation on all), "
        f"prompts `{setup.prompt_tokens}` tokens, outputs `{setup.output_tokens}` tokens (end id "
        f"off), greedy, generation `stream_interval` {setup.stream_interval} (a streamed "
        f"response every {setup.stream_interval} decode step(s)), gRPC streaming client "
        + (f"and front end on cores {','.join(map(str, setup.front))} of their own"
           if setup.front else "on the same cores (disaggregated: with the front end on the "
           "context's)")
        + f" (the client's CPU use is the last column). SLO: TTFT <= "
        f"{setup.slo.ttft * 1e3:.0f} ms and time per output token <= {setup.slo.tpot * 1e3:.0f} "
        f"ms. Rates: {setup.sweep.describe()}. The whole run took {setup.seconds:.0f} s.",
        "", "### Request-rate sweep (open loop, Poisson arrivals)", "",
        "`serial`: one request at a time (unloaded latency); `burst`: every request at once "
        f"(saturation throughput); each the best of {BEST_OF} runs of the same requests "
        "(serial by TTFT p50, burst by output tok/s: the run least disturbed on a shared "
        "machine); each swept rate runs once. TPOT is per request, (last - first token) / (tokens - 1); ITL "
        "pools every gap between streamed tokens.", "",
        sweep_table(summaries), "",
        f"**Goodput** (highest swept rate with >= {GOODPUT_ATTAINMENT:.0%} SLO attainment): "
        + ", ".join(f"{m} {'none' if g is None else f'{g:g} req/s'}" for m, g in good.items())
        + ".", "",
        *verdicts(summaries, modes, setup.sweep), "",
        *[f"![{p.stem}]({os.path.relpath(p, doc_dir)})" for p in images], "",
        "### Serving overhead (Triton vs the engine in-process, same prompts and cores)", "",
        "TTFT at p50 with one request at a time, output tokens/s with every request at once, "
        f"in {BEST_OF} paired rounds per mode: the serial and burst sets in-process, then the "
        "same on the server, seconds apart (the machine's speed drifts over minutes; each "
        "round's figures share its speed). Each round's added TTFT / lost throughput is "
        "listed; the verdict takes the median round.", "",
        *overhead_lines(summaries, modes, setup.stream_interval, rounds, split), "",
        "Where the CPU went during the burst: each process's user + system time from `/proc` "
        "(every thread: generation's decode loop, the orchestrator's event loop, Triton's "
        "ensemble and gRPC), and the benchmark's own client; share of the cores = CPU / "
        "(burst seconds x cores):", "",
        process_cpu_table(times, len(setup.cores)), "",
        "### Deployment-guide acceptance (TTFT p90 under 200 ms and over 1000 output tokens/s)", "",
        *acceptance_lines(summaries, modes),
    ]
    return "\n".join(parts)

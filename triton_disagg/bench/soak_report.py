"""`bench soak`'s result per strategy, its verdict and its markdown.

Hard criteria (any one fails the strategy, and the command exits 1): a client that did
not run to its end (its thread raised, e.g. genai-perf's loop with no run that measured a
request, or still ran when the soak stopped waiting) or a load tool run that failed (an
unexpected error: see :mod:`.soak_tools`); a hung request;
a crash (``Fatal Python error`` or ``Segmentation fault`` in tritonserver's log, a stub
that died, tritonserver or ``serve`` gone); KV blocks still used, or no pool gauge at all,
after the settle; an unexpected error (a good request that failed, a bad input that was
answered as if fine); a request read to its end whose token count disagrees with
``num_output_tokens`` or ``max_tokens`` (tokens lost on the way; counted apart as well).
Stub memory must stay within ``RSS_FLAT`` over the last half of
the load; it is judged when that window is at least ``RSS_MIN_WINDOW`` seconds (a 1-minute
CI run is mostly warm-up) and shown in any case. tritonserver's own memory is shown with
its growth but not judged: it is Triton's C++ process, not a model's stub, and it creeps
up under this load by 1-2 KiB per request with glibc's malloc or jemalloc alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from triton_disagg.bench.soak_clients import LONG_PROMPT
from triton_disagg.bench.soak_server import Crashes
from triton_disagg.bench.soak_watch import (RSS_FLAT, SECONDS_PER_TOKEN, SLACK_SECONDS, RssRow,
                                            Tally)

RSS_MIN_WINDOW = 120.0


@dataclass
class StrategyResult:
    strategy: str
    placement: str
    ready_seconds: float
    load_seconds: float
    drain_seconds: float                     # load's end until every client was done
    tallies: dict[str, Tally]                # client kind -> counts, in table order
    crashes: Crashes
    pools: dict[str, float]                  # model instance -> blocks used after the settle
    settle_seconds: float
    rss: list[RssRow]
    rss_window: float                        # seconds of load the RSS rows cover
    notes: list[str] = field(default_factory=list)
    client_failures: dict[str, str] = field(default_factory=dict)   # client -> what ended it

    @property
    def judge_rss(self) -> bool:
        return self.rss_window >= RSS_MIN_WINDOW

    def total(self) -> Tally:
        out = Tally()
        for t in self.tallies.values():
            for name in ("sent", "ok", "expected_error", "unexpected_error", "hung", "open",
                         "miscounted"):
                setattr(out, name, getattr(out, name) + getattr(t, name))
        return out

    def failures(self) -> list[str]:
        """The hard criteria this run failed, in words (empty: it passed)."""
        total = self.total()
        out = [f"client {name} failed: {why}" for name, why in self.client_failures.items()]
        if total.hung + total.open:
            out.append(f"{total.hung + total.open} hung requests")
        if self.crashes.total:
            out.append(f"{self.crashes.total} crashes")
        leaked = sum(self.pools.values())
        if leaked:
            out.append(f"{leaked:.0f} KV blocks still used after {self.settle_seconds:.0f} s")
        if not self.pools:
            out.append("no disagg_kv_blocks_used gauge on /metrics after the load")
        if total.unexpected_error:
            out.append(f"{total.unexpected_error} unexpected errors")
        if total.miscounted:
            out.append(f"{total.miscounted} requests whose token count disagrees with "
                       f"num_output_tokens or max_tokens")
        drifting = [r.process for r in self.rss if r.judged and not r.flat]
        if self.judge_rss and drifting:
            out.append(f"RSS not flat within {RSS_FLAT:.0%}: {', '.join(drifting)}")
        if self.judge_rss and not self.rss:
            out.append("no RSS samples of the stub processes")
        return out

    @property
    def verdict(self) -> str:
        return "FAIL" if self.failures() else "PASS"


def _row(name: str, t: Tally, bold: bool = False) -> str:
    cells = [t.sent, t.ok, t.expected_error, t.unexpected_error, t.miscounted, t.hung + t.open]
    text = [f"**{c}**" if bold else str(c) for c in cells]
    return f"| {f'**{name}**' if bold else name} | " + " | ".join(text) + " |"


def strategy_markdown(r: StrategyResult) -> str:
    lines = [f"### {r.strategy}: {r.verdict}", "",
             f"{r.placement}; ready in {r.ready_seconds:.0f} s; load {r.load_seconds:.0f} s, "
             f"then {r.drain_seconds:.0f} s until every client had ended.", "",
             "| client | sent | ok | refused as expected | unexpected errors | wrong token count "
             "| hung |", "|---|--:|--:|--:|--:|--:|--:|"]
    lines += [_row(name, t) for name, t in r.tallies.items()]
    lines += [_row("all", r.total(), bold=True), ""]
    c = r.crashes
    lines.append(f"Crashes: {c.total} ({c.fatal} `Fatal Python error`, {c.segfault} "
                 f"`Segmentation fault`, {c.stub_deaths} stub deaths, {c.server_exits} server "
                 f"exits). KV blocks used once the clients had ended (settled in "
                 f"{r.settle_seconds:.0f} s): "
                 + (", ".join(f"{k} {v:.0f}" for k, v in sorted(r.pools.items())) or "no gauge")
                 + ".")
    lines += ["", f"RSS over the last {r.rss_window:.0f} s of load (sampled every 5 s)"
              + ("" if r.judge_rss else f"; not judged, the window is under "
                                        f"{RSS_MIN_WINDOW:.0f} s") + ":", "",
              "| process | samples | first MiB | last MiB | max MiB | spread | flat |",
              "|---|--:|--:|--:|--:|--:|---|"]
    for row in r.rss:
        flat = ("yes" if row.flat else "**no**") + (" (restarted)" if row.restarted else "")
        flat += "" if row.judged else " (shown, not judged)"
        lines.append(f"| {row.process} | {row.samples} | {row.first_mib:.0f} | {row.last_mib:.0f}"
                     f" | {row.max_mib:.0f} | {row.spread:.1%} | {flat} |")
    problems = [f"{name}: {e}" for name, t in r.tallies.items() for e in t.examples]
    problems += [f"log: {e}" for e in c.evidence] + r.notes
    problems += [f"tritonserver.log error line (not counted as a crash), {n}x: `{m}`"
                 for m, n in c.error_lines.most_common(3)]
    if problems:
        lines += ["", "What went wrong:", ""] + [f"- {p}" for p in problems]
    if r.failures():
        lines += ["", "Failed: " + "; ".join(r.failures()) + "."]
    return "\n".join(lines)


def markdown(results: list[StrategyResult], minutes: float, command: str) -> str:
    intro = (
        f"`{command}`: `serve all` with two generation instances per KV strategy, "
        f"{minutes:g} min of mixed load each: genai-perf in time-window mode back to back "
        f"(concurrency 4, 64-token prompts, 24-token replies, 8 s windows), locust with its "
        f"gRPC and SSE users, clients that cancel streams after the first token or mid-way "
        f"(gRPC `stop_stream(cancel_requests=True)`, SSE connection closed) between complete "
        f"requests, long prompts ({LONG_PROMPT[0]:,}-{LONG_PROMPT[1]:,} tokens) cancelled at "
        f"their first token while generation still takes their KV, and a trickle of bad "
        f"inputs that must be refused. A request is hung when "
        f"it has not ended {SLACK_SECONDS:.0f} s + {SECONDS_PER_TOKEN} s per max_tokens after "
        f"it was sent. After the load: a settle until the KV pools are empty, one more "
        f"request, then the server's logs are searched for crashes.")
    summary = ["| strategy | sent | hung | unexpected errors | wrong token count | crashes | "
               "leaked blocks | stub RSS flat | verdict |",
               "|---|--:|--:|--:|--:|--:|--:|---|---|"]
    for r in results:
        t = r.total()
        flat = "yes" if all(row.flat for row in r.rss if row.judged) else "no"
        summary.append(f"| {r.strategy} | {t.sent} | {t.hung + t.open} | {t.unexpected_error} | "
                       f"{t.miscounted} | {r.crashes.total} | {sum(r.pools.values()):.0f} | "
                       f"{flat if r.judge_rss else f'{flat} (not judged)'} | {r.verdict} |")
    return "\n\n".join([intro, "\n".join(summary)] + [strategy_markdown(r) for r in results])

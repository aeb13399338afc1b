"""`triton-disagg bench stall`: how much a long prompt's KV handoff stalls the streams that
are already decoding on the same generation instance.

Six streams decode (each slot starts a new stream when one ends) while a long prompt
arrives every ``--period`` seconds. An arrival's handoff lies between its first token
(from the context) and its second (its first decode step). For each arrival, the bench
takes the running streams' longest inter-token gap overlapping that window; the figure is
the median of those over the arrivals against the median of all the streams' gaps
(1.0: a handoff costs the streams nothing).

The same statistic over windows where no handoff lies is the figure's *floor*: windows of
each arrival's length a quarter, a half and three quarters of a period after it (those
that meet an arrival's window are left out). The longest of several streams' gaps is
above their median gap even when nothing stalls them (the gaps vary), so the floor says
how far below it the ratio can go on this machine; with ``--overlap`` those windows
still hold other arrivals' layer READs, which run during the prefills.

Invariant: every gap is one stream's two consecutive responses as this client saw them
(``stream_interval`` 1: a response per token); an arrival whose first two tokens came in
one response (its KV landed before the first token left the server) has a window of no
length at that response. An arrival with fewer than two tokens (failed), or during whose
window every stream waited for its first token (no gap to overlap), is left out (and
counted).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from triton_disagg.bench.args import add_engine_arg, bench_engine, cpus_arg
from triton_disagg.bench.report import progress, publish
from triton_disagg.errors import UserError
from triton_disagg.kv.connector import STRATEGIES

STREAMS = 6
STREAM_PROMPT_TOKENS = 32
STREAM_MAX_TOKENS = 300
WARMUP_SECONDS = 3.0       # streams running, and one long prompt through, before arrivals


def add_stall_parser(kinds) -> None:
    p = kinds.add_parser(
        "stall", help="running streams' longest gap during a long prompt's KV handoff, "
                      "against their median gap")
    add_engine_arg(p)
    p.add_argument("--strategy", default="direct_transfer", choices=list(STRATEGIES))
    p.add_argument("--prompt-tokens", type=int, default=1800)
    p.add_argument("--arrivals", type=int, default=24)
    p.add_argument("--period", type=float, default=1.0, help="seconds between arrivals")
    p.add_argument("--repeats", type=int, default=1, help="runs; the best ratio is kept")
    p.add_argument("--cpus", default="0,1", help="context on the first half, generation on "
                                                 "the rest (default 0,1)")
    p.add_argument("--overlap", action="store_true",
                   help="serve with --overlap_kv_transfer (direct_transfer only)")
    p.add_argument("--label", default="this tree", help="names the row (e.g. a commit)")
    p.add_argument("--work-dir", type=Path, default=Path("work/bench"))
    p.add_argument("--output", type=Path, help="markdown file whose stall section is replaced")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class Stall:
    label: str
    arrivals: int               # arrivals with a handoff window
    skipped: int                # left out: under two tokens (failed), or no stream running
    window_max_gap_s: float     # median over arrivals of the longest overlapping gap
    median_gap_s: float         # median of every stream gap
    stream_gaps: int
    floor_gap_s: float          # the same median over handoff-free windows
    server: str = ""            # the generation server's own KV figures over the run


    @property
    def ratio(self) -> float:
        return self.window_max_gap_s / self.median_gap_s

    @property
    def floor(self) -> float:
        return self.floor_gap_s / self.median_gap_s


FLOOR_SHIFTS = (0.25, 0.5, 0.75)     # handoff-free windows: these fractions of a period later


def stall_figures(label: str, streams: Sequence[Sequence[float]],
                  arrivals: Sequence[Sequence[float]], period: float) -> Stall:
    """``streams``: each running stream's response times; ``arrivals``: each long prompt's
    token times (its first two tokens bound the handoff window; two tokens that came in one
    response make a window of no length, which the stream gaps spanning that moment
    overlap); ``period``: seconds between arrivals (for the floor's windows). Times on one
    clock."""
    gaps = [(a, b) for times in streams for a, b in zip(times, times[1:])]
    if not gaps:
        raise UserError("bench stall: the streams produced no inter-token gaps")
    def longest(start: float, end: float) -> Optional[float]:
        return max((b - a for a, b in gaps if b > start and a < end), default=None)

    windows = [(times[0], times[1]) for times in arrivals if len(times) >= 2]
    worst = [w for w in (longest(*window) for window in windows) if w is not None]
    if not worst:
        raise UserError("bench stall: no arrival's handoff window overlapped a stream")
    free = [(start + f * period, end + f * period) for start, end in windows
            for f in FLOOR_SHIFTS]
    free = [(s, e) for s, e in free if not any(e >= a and s <= b for a, b in windows)]
    floor = [w for w in (longest(*window) for window in free) if w is not None]
    return Stall(label, len(worst), len(arrivals) - len(worst), statistics.median(worst),
                 statistics.median(b - a for a, b in gaps), len(gaps),
                 statistics.median(floor) if floor else float("nan"))


async def _load(grpc_url: str, stream_prompts: Sequence[str], long_prompts: Sequence[str],
                period: float) -> tuple[list[list[float]], list[list[float]]]:
    import tritonclient.grpc.aio as aio

    from triton_disagg.clients.stream import GenerateRequest, grpc_generate

    streams: list[list[float]] = []
    arrivals: list[list[float]] = []
    done = asyncio.Event()
    async with aio.InferenceServerClient(grpc_url) as client:
        async def slot(prompt: str) -> None:
            while not done.is_set():
                m = await grpc_generate(client, GenerateRequest(prompt, STREAM_MAX_TOKENS))
                streams.append(m.arrivals)

        slots = [asyncio.create_task(slot(p)) for p in stream_prompts]
        await grpc_generate(client, GenerateRequest(long_prompts[0], 2))    # warm the path
        await asyncio.sleep(WARMUP_SECONDS)
        tasks, start = [], time.perf_counter()
        for i, prompt in enumerate(long_prompts):
            await asyncio.sleep(max(0.0, start + i * period - time.perf_counter()))
            tasks.append(asyncio.create_task(grpc_generate(client, GenerateRequest(prompt, 2))))
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            arrivals.append([] if isinstance(result, BaseException) else result.token_times)
        done.set()
        await asyncio.gather(*slots)
    return streams, arrivals


def measure(args: argparse.Namespace, engine: Path, say) -> Stall:
    from triton_disagg.bench.handoff import exact_prompt, serving
    from triton_disagg.front.tokenizer import Tokenizer
    from triton_disagg.routing.scrape import scrape

    cores = cpus_arg(args.cpus)
    tokenizer, rng = Tokenizer(engine), random.Random(0)
    stream_prompts = [exact_prompt(tokenizer, STREAM_PROMPT_TOKENS, rng) for _ in range(STREAMS)]
    long_prompts = [exact_prompt(tokenizer, args.prompt_tokens, rng)
                    for _ in range(args.arrivals + 1)]
    best = None
    with serving(args.strategy, engine, cores, (args.work_dir / "stall").resolve(),
                 overlap=args.overlap) as (_, metrics, grpc_url):
        for repeat in range(args.repeats):
            before = scrape(metrics)
            streams, arrivals = asyncio.run(_load(grpc_url, stream_prompts, long_prompts[1:],
                                                  args.period))
            stall = replace(stall_figures(args.label, streams, arrivals, args.period),
                            server=server_figures(before, scrape(metrics)))
            say(f"run {repeat + 1}: {_row(stall, _strategy(args))}")
            best = stall if best is None or stall.ratio < best.ratio else best
    return best


def server_figures(before, after) -> str:
    """Mean KV copy and mean KV in flight per handoff, the share of that in flight time
    hidden behind other sequences' compute, and decode steps blocked by a transfer, from the
    server's metrics between two scrapes ("n/a" for a series the server does not publish)."""
    from triton_disagg.routing.scrape import delta

    def mean_ms(name: str) -> str:
        count = delta(before, after, f"{name}_count")
        return f"{delta(before, after, f'{name}_sum') / count * 1e3:.1f} ms" if count else "n/a"

    blocked = "disagg_decode_steps_blocked_by_transfer_total"
    steps = f"{delta(before, after, blocked):g}" if blocked in after else "n/a"
    in_flight = delta(before, after, "disagg_kv_fetch_seconds_sum")
    hidden = (f"{delta(before, after, 'disagg_kv_fetch_hidden_seconds_sum') / in_flight:.0%}"
              if in_flight and "disagg_kv_fetch_hidden_seconds_sum" in after else "n/a")
    return (f"copy {mean_ms('disagg_kv_transfer_seconds')}, in flight "
            f"{mean_ms('disagg_kv_fetch_seconds')} ({hidden} hidden), steps blocked {steps}")


def _strategy(args: argparse.Namespace) -> str:
    return args.strategy + (" + overlap" if args.overlap else "")


def _row(s: Stall, strategy: str) -> str:
    return (f"| {s.label} | {strategy} | {s.arrivals} ({s.skipped} skipped) | "
            f"{s.window_max_gap_s * 1e3:.1f} ms | {s.median_gap_s * 1e3:.1f} ms "
            f"({s.stream_gaps} gaps) | {s.ratio:.2f} | {s.floor_gap_s * 1e3:.1f} ms, "
            f"{s.floor:.2f} | {s.server} |")


def run(args: argparse.Namespace) -> int:
    if args.arrivals < 1 or args.period <= 0 or args.repeats < 1:
        raise UserError("bench stall: --arrivals and --repeats must be >= 1, --period > 0")

    say = progress("stall")

    engine = bench_engine(args.engine, args.work_dir, say)
    stall = measure(args, engine, say)
    body = markdown(stall, args)
    publish(body, args.output, "stall", "KV handoff stalls of running streams", say)
    return 0


def markdown(stall: Stall, args: argparse.Namespace) -> str:
    return "\n".join([
        f"`triton-disagg bench stall`: `serve all` of the demo engine, {args.strategy}, "
        f"cores {args.cpus} (context and front end on the first half, generation on the "
        f"rest). {STREAMS} streams of {STREAM_MAX_TOKENS} tokens decode back to back while "
        f"a {args.prompt_tokens}-token prompt (max_tokens 2) arrives every {args.period:g} s, "
        f"{args.arrivals} arrivals after {WARMUP_SECONDS:g} s of warm-up; best ratio of "
        f"{args.repeats} run(s). Per arrival: the longest gap between two consecutive "
        f"responses of any stream that overlaps the arrival's first-to-second-token window; "
        f"the ratio is the median of those over the median of all stream gaps (1.0: a "
        f"handoff costs the streams nothing). The floor is the same figure over windows "
        f"of the same lengths a quarter, a half and three quarters of a period after each "
        f"arrival's, where no handoff lies (with overlap, other arrivals' layer READs do): "
        f"the longest of several streams' gaps is above their median even when nothing "
        f"stalls them, so no handoff can take the ratio below it. The last column is the "
        f"generation server's own metrics over the run.", "",
        "| tree | strategy | arrivals | median longest gap in a handoff window "
        "| median stream gap | ratio | floor (handoff-free windows) "
        "| generation server (KV per handoff) |",
        "|---|---|---|---|---|---|---|---|",
        _row(stall, _strategy(args))]) + "\n"

"""`triton-disagg bench front`: the HTTP front's OpenAI SSE path beside gRPC streaming to the
ensemble, on one `serve all` (disaggregated), in one run.

Order: start the server with its front, warm both paths up, then ``BEST_OF`` rounds, each
sending the same serial set (one request at a time: unloaded time to first token) and
the same burst (every request at once: saturation throughput) over gRPC, then over the
front. Each path keeps its best round (:func:`serve_stats.best_index`). Figures: TTFT p50
per path and what the front adds to it (ms), token throughput per path and the front's
ratio to gRPC. The client runs on the front end's cores, as in `bench serve`.

Invariant: both paths get the same requests (same seed), greedy with the end id off, so
each reply has exactly its ``max_tokens`` tokens.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from triton_disagg.bench.args import add_engine_arg, bench_engine, cpus_arg
from triton_disagg.bench.report import progress, publish
from triton_disagg.errors import UserError

BEST_OF = 3
WARMUP_REQUESTS = 4
PATHS = ("gRPC stream (ensemble)", "OpenAI SSE (front)")


def add_front_parser(kinds) -> None:
    p = kinds.add_parser(
        "front", help="the HTTP front's OpenAI SSE path beside gRPC streaming: TTFT added "
                      "and saturation throughput ratio",
        description="One `serve all` with its HTTP front; the same serial requests and burst "
                    "over gRPC streaming (ensemble) and over /v1/completions (SSE).")
    add_engine_arg(p)
    p.add_argument("--cpus", help="cores for the server (default: every usable core)")
    p.add_argument("--prompt-tokens", default="uniform:32,128", help="length distribution")
    p.add_argument("--output-tokens", default="uniform:32,96", help="length distribution")
    p.add_argument("--serial-requests", type=int, default=12)
    p.add_argument("--burst-requests", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, default=Path("work/bench-front"))
    p.add_argument("--output", type=Path, default=None,
                   help="markdown file whose front section is replaced with the figures")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from triton_disagg.bench.affinity import pinned
    from triton_disagg.bench.serve_cli import make_requests
    from triton_disagg.clients.load import run_load, run_openai_load
    from triton_disagg.bench.serve_servers import serving
    from triton_disagg.bench.serve_stats import SLO, best_index, summarize
    from triton_disagg.front.tokenizer import Tokenizer

    if args.serial_requests < 1 or args.burst_requests < 1:
        raise UserError("--serial-requests and --burst-requests must be positive")
    cores = cpus_arg(args.cpus)

    say = progress("front")

    engine = bench_engine(args.engine, args.work_dir, say)
    tokenizer = Tokenizer(engine)
    serial = make_requests(args.serial_requests, args, tokenizer, args.seed)
    burst = make_requests(args.burst_requests, args, tokenizer, args.seed + 1)
    no_slo = SLO(math.inf, math.inf)
    runs: dict[tuple[str, str], list] = {(p, k): [] for p in PATHS for k in ("serial", "burst")}
    say(f"starting disaggregated serving with its HTTP front on cores {cores}")
    with serving("disaggregated", engine, cores, args.work_dir.resolve(),
                 openai=True) as served, pinned(served.front):
        send = {PATHS[0]: lambda reqs, rate: run_load(served.grpc, reqs, rate),
                PATHS[1]: lambda reqs, rate: run_openai_load(served.openai, served.model,
                                                             reqs, rate)}
        warmup = make_requests(WARMUP_REQUESTS, args, tokenizer, -1)
        for path in PATHS:
            send[path](warmup, math.inf)
        for i in range(BEST_OF):
            for path in PATHS:
                for kind, requests, rate in (("serial", serial, 0), ("burst", burst, math.inf)):
                    s = summarize(path, send[path](requests, rate), no_slo)
                    if s.failed:
                        raise UserError(f"{path} {kind}: {s.failed} requests failed: "
                                        f"{'; '.join(s.errors)}")
                    runs[path, kind].append(s)
                    say(f"round {i + 1}/{BEST_OF} {path} {kind}: TTFT p50 "
                        f"{s.ttft.p50 * 1e3:.1f} ms, {s.token_throughput:.0f} tok/s")
    best = {key: ss[best_index(ss)] for key, ss in runs.items()}
    body = report(best, cores, args)
    publish(body, args.output, "front", "HTTP front: OpenAI SSE vs gRPC streaming", say,
            notes=HOW)
    return 0


HOW = """gRPC is tritonclient's asyncio streaming to the `ensemble`; the front path is
`/v1/completions` with `"stream": true` over aiohttp, TTFT measured from the send to the
first SSE chunk with text. The front tokenizes in its own process and calls the
`orchestrator` directly, so it skips the ensemble's scheduling and the `preprocessing`
stub crossing that the gRPC path pays, and pays one HTTP hop and SSE framing instead."""


def report(best: dict, cores, args: argparse.Namespace) -> str:
    """The markdown table: TTFT p50 (serial) and token throughput (burst) per path."""
    grpc, front = PATHS
    rows = ["| path | TTFT p50, serial (ms) | TTFT p90, serial (ms) | burst tok/s |",
            "|---|---:|---:|---:|"]
    for path in PATHS:
        s, b = best[path, "serial"], best[path, "burst"]
        rows.append(f"| {path} | {s.ttft.p50 * 1e3:.1f} | {s.ttft.p90 * 1e3:.1f} | "
                    f"{b.token_throughput:.0f} |")
    added = (best[front, "serial"].ttft.p50 - best[grpc, "serial"].ttft.p50) * 1e3
    ratio = best[front, "burst"].token_throughput / best[grpc, "burst"].token_throughput
    return "\n".join([
        f"`triton-disagg bench front`: one `serve all` (disaggregated), {len(cores)} core(s), prompts {args.prompt_tokens} tokens, outputs "
        f"{args.output_tokens} tokens; serial {args.serial_requests} requests one at a time, "
        f"burst {args.burst_requests} at once; best of {BEST_OF} rounds per path.", "",
        *rows, "",
        f"The front adds **{added:+.1f} ms** to TTFT p50; its saturation throughput is "
        f"**{ratio:.2f}x** gRPC's."])

"""`triton-disagg bench serve`: disaggregated vs aggregated serving of one engine, in one run.

Order of a run (every server on the same cores, one at a time):

1. the in-process baseline (:mod:`serve_inproc`): the serial and burst request
   sets on :class:`LLMEngine` in this process, on all the cores; then, when
   disaggregated is measured, the same engine on the split's cores
   (:func:`split_baseline`);
2. per mode: start the server, warm it up, then, with the client on the front
   end's cores, one Poisson run per rate of the sweep (``rate x --duration``
   requests; :mod:`serve_stats`: by default ``--rate-step``, twice that, ... until
   the mode misses its SLO or reaches ``--max-rate``; with ``--rates``, exactly
   those), then ``BEST_OF`` paired rounds: the serial and burst sets in-process,
   then the same on the server (:mod:`triton_disagg.clients.load`), reading each server process's
   CPU time around its burst (:mod:`process_cpu`); then stop it. The overhead is
   judged on the rounds (:class:`serve_report.Round`): on a shared machine whose
   speed drifts over minutes, only figures taken seconds apart compare;
3. the figures (:mod:`serve_stats`), markdown and plots (:mod:`serve_report`):
   printed, and with ``--output`` kept as the ``serve`` section of that file
   with the PNGs in ``--img-dir``.

Invariant: every mode and the baseline get the same requests (same seed; the
i-th rate of the sweep gets the same set in every mode), so their rows compare
one to one.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from triton_disagg.bench.args import add_engine_arg, bench_engine, cpus_arg, number_list
from triton_disagg.bench.report import progress, publish, shown_path
from triton_disagg.errors import UserError

if TYPE_CHECKING:
    from triton_disagg.bench.serve_report import SplitBaseline

WARMUP_REQUESTS = 4
RATE_STEP, MAX_RATE = 4.0, 64.0     # the default sweep: 4, 8, ... req/s, at most up to 64


def add_serve_parser(kinds) -> None:
    p = kinds.add_parser(
        "serve", help="TTFT, per-token latency, throughput and goodput through Triton, "
                      "disaggregated vs aggregated, and the serving overhead",
        description="Open-loop Poisson load at rising request rates against `serve all`, "
                    "disaggregated and aggregated in turn on the same cores, plus the engine "
                    "in-process on the same prompts.")
    add_engine_arg(p)
    p.add_argument("--modes", default="disaggregated,aggregated")
    p.add_argument("--rates", help="requests/s, comma-separated: sweep exactly these, every "
                                   "one in every mode (default: the stepped sweep below)")
    p.add_argument("--rate-step", type=float,
                   help=f"the default sweep: STEP, 2 x STEP, ... req/s, each mode until it "
                        f"misses its SLO (default {RATE_STEP:g})")
    p.add_argument("--max-rate", type=float,
                   help=f"the default sweep's cap in req/s (default {MAX_RATE:g})")
    p.add_argument("--duration", type=float, default=12.0,
                   help="seconds of arrivals per rate (default 12)")
    p.add_argument("--prompt-tokens", default="uniform:32,128", help="length distribution")
    p.add_argument("--output-tokens", default="uniform:32,96", help="length distribution")
    p.add_argument("--serial-requests", type=int, default=16,
                   help="requests sent one at a time (unloaded latency, overhead)")
    p.add_argument("--burst-requests", type=int, default=64,
                   help="requests sent at once (saturation throughput, overhead)")
    p.add_argument("--slo-ttft-ms", type=float, default=200.0,
                   help="SLO: time to first token (default 200)")
    p.add_argument("--slo-tpot-ms", type=float, default=50.0,
                   help="SLO: time per output token (default 50); a rate meets the SLO when "
                        "90%% of its requests meet both")
    p.add_argument("--cpus", help="cores for every configuration, e.g. 0,1 (default: all usable)")
    p.add_argument("--front-cpus",
                   help="cores of their own for the front end (tritonserver, preprocessing, "
                        "orchestrator) and this benchmark's client, in both modes, e.g. 2,3 "
                        "(default: the context's cores when disaggregated, unpinned when "
                        "aggregated); on a host with cores to spare, the engines then get "
                        "exactly the baseline's --cpus")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="generation_server.stream_interval for both modes (default 1: a "
                        "response per token); other values keep their own docs section")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, default=Path("work/bench-serve"))
    p.add_argument("--output", type=Path, help="markdown file whose serve section is replaced")
    p.add_argument("--img-dir", type=Path, help="where the PNGs go (default: img/ beside --output)")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    p.set_defaults(func=run)


def _sweep(args: argparse.Namespace):
    from triton_disagg.bench.serve_stats import Sweep

    if args.rates is None:
        return Sweep.stepped(RATE_STEP if args.rate_step is None else args.rate_step,
                             MAX_RATE if args.max_rate is None else args.max_rate)
    if args.rate_step is not None or args.max_rate is not None:
        raise UserError("--rates sweeps exactly the rates given; leave out --rate-step and "
                        "--max-rate, or --rates")
    return Sweep.explicit(number_list(args.rates, "--rates"))


def make_requests(n: int, args: argparse.Namespace, tokenizer, seed: int) -> list:
    """``n`` streaming, greedy requests with end id off (exactly ``max_tokens`` tokens each)."""
    from triton_disagg.clients.stream import GenerateRequest
    from triton_disagg.clients.workload import Lengths, make_prompt

    prompts = Lengths.parse(args.prompt_tokens, "--prompt-tokens")
    outputs = Lengths.parse(args.output_tokens, "--output-tokens")
    rng = random.Random(seed)
    return [GenerateRequest(make_prompt(prompts.sample(rng), rng, tokenizer), outputs.sample(rng),
                            True, {"end_id": -1}) for _ in range(n)]


def split_baseline(engine: Path, cores: Sequence[int], serial: list, burst: list, keep,
                   say) -> "SplitBaseline":
    """The engine in-process on the disaggregated split's cores: the serial requests on
    the context's cores (row ``IN_PROCESS_CONTEXT``: the TTFT a server with that prefill
    placement starts from) and the decode ceiling on generation's (the most it can
    stream); each the best of ``BEST_OF`` runs."""
    from triton_disagg.bench.affinity import pinned
    from triton_disagg.bench.serve_inproc import InProcessEngine
    from triton_disagg.bench.serve_report import BEST_OF, IN_PROCESS_CONTEXT, SplitBaseline
    from triton_disagg.bench.serve_servers import placement

    split = placement("disaggregated", cores)
    context, generation = split["context_server"]["cpus"], split["generation_server"]["cpus"]
    say(f"in-process on the split: prefill on cores {context}, decode on cores {generation}")
    with pinned(context):
        engine_here = InProcessEngine(engine, threads=len(context))
        keep(IN_PROCESS_CONTEXT, *[engine_here.run(serial, 0) for _ in range(BEST_OF)])
        engine_here.close()
    with pinned(generation):
        engine_here = InProcessEngine(engine, threads=len(generation))
        ceiling = max(engine_here.decode_rate(burst) for _ in range(BEST_OF))
        engine_here.close()
    return SplitBaseline(tuple(context), tuple(generation), ceiling)


def run(args: argparse.Namespace) -> int:
    from triton_disagg.bench import serve_report
    from triton_disagg.bench.affinity import pinned
    from triton_disagg.bench.extras import require
    from triton_disagg.bench.serve_inproc import InProcessEngine
    from triton_disagg.clients.load import run_load
    from triton_disagg.bench.process_cpu import cpu_delta, server_cpu
    from triton_disagg.bench.serve_servers import MODES, serving
    from triton_disagg.bench.serve_report import BEST_OF, Round
    from triton_disagg.bench.serve_stats import SLO, Summary, best_index, summarize
    from triton_disagg.front.tokenizer import Tokenizer

    require("matplotlib", "bench serve plots with matplotlib")
    began = time.monotonic()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        raise UserError(f"--modes: {args.modes!r}; choose from {', '.join(MODES)}")
    sweep = _sweep(args)
    cores = cpus_arg(args.cpus)
    front = (number_list(args.front_cpus, "--front-cpus", int, allow_zero=True)
             if args.front_cpus is not None else [])
    if args.serial_requests < 1 or args.burst_requests < 1 or args.duration <= 0:
        raise UserError("--serial-requests, --burst-requests and --duration must be positive")
    if args.stream_interval < 1:
        raise UserError(f"--stream-interval: {args.stream_interval} must be >= 1")
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)

    say = progress("serve")

    engine = bench_engine(args.engine, args.work_dir, say)
    tokenizer = Tokenizer(engine)
    serial = make_requests(args.serial_requests, args, tokenizer, args.seed)
    burst = make_requests(args.burst_requests, args, tokenizer, args.seed + 1)
    summaries, times = [], {}

    def keep(mode: str, *runs) -> int:
        """Summarize ``runs`` of one request set and keep the best (:func:`best_index`);
        returns its index."""
        candidates = [summarize(mode, run, slo) for run in runs]
        best = best_index(candidates)
        s = candidates[best]
        summaries.append(s)
        ttft = "–" if s.ttft is None else f"{s.ttft.p50 * 1e3:.1f} ms"
        tried = "" if len(runs) == 1 else f" (best of {len(runs)})"
        say(f"{mode:>13} rate {s.rate:g}{tried}: {s.sent - s.failed}/{s.sent} done, "
            f"{s.token_throughput:.0f} tok/s, TTFT p50 {ttft}, attainment {s.attainment:.0%}"
            + (f", errors: {'; '.join(s.errors)}" if s.errors else ""))
        return best

    say(f"in-process baseline on {len(cores)} thread(s)")
    baseline = InProcessEngine(engine, threads=len(cores))
    keep("in-process", *[baseline.run(serial, 0) for _ in range(BEST_OF)])
    keep("in-process", *[baseline.run(burst, math.inf) for _ in range(BEST_OF)])
    split = (split_baseline(engine, cores, serial, burst, keep, say)
             if "disaggregated" in modes and len(cores) > 1 else None)
    rounds: dict[str, list[Round]] = {}
    for mode in modes:
        say(f"starting {mode} serving on cores {cores}")
        with serving(mode, engine, cores, args.work_dir.resolve(), args.stream_interval,
                     front=front) as served, pinned(served.front):
            run_load(served.grpc, make_requests(WARMUP_REQUESTS, args, tokenizer, -1), math.inf)

            def point(i: int, rate: float) -> Summary:
                requests = make_requests(max(1, round(rate * args.duration)), args, tokenizer,
                                         args.seed + 2 + i)
                keep(mode, run_load(served.grpc, requests, rate, seed=args.seed + i,
                                    deadline=args.duration * 4 + 60))
                return summaries[-1]
            sweep.run(mode, point, say)
            serials, bursts, cpu_rows, rounds[mode] = [], [], [], []
            for _ in range(BEST_OF):
                # One paired round: the engine in-process, then the server, back to back.
                with pinned(cores):
                    base_serial, base_burst = baseline.run(serial, 0), baseline.run(burst, math.inf)
                serials.append(run_load(served.grpc, serial, 0))
                before = server_cpu(served.pid)
                bursts.append(run_load(served.grpc, burst, math.inf))
                cpu_rows.append(cpu_delta(before, server_cpu(served.pid)))
                rounds[mode].append(Round.of(*(summarize(mode, r, slo) for r in (
                    base_serial, serials[-1], base_burst, bursts[-1]))))
            keep(mode, *serials)
            best = keep(mode, *bursts)
            times[mode] = (bursts[best].duration, cpu_rows[best] + [
                ("client (this benchmark)", bursts[best].client_cpu or 0.0)])
    baseline.close()
    appeared = {m: i for i, m in enumerate(dict.fromkeys(s.mode for s in summaries))}
    summaries.sort(key=lambda s: (appeared[s.mode], s.rate))   # per mode: serial, rates, burst

    shown = shown_path(engine)
    setup = serve_report.Setup(shown, tuple(cores), args.prompt_tokens, args.output_tokens,
                               slo, sweep, time.monotonic() - began, args.stream_interval,
                               tuple(front))
    # The default run owns section "serve"; another interval keeps a section of its own.
    section, title = "serve", "Serving: disaggregated vs aggregated"
    if args.stream_interval != 1:
        section += f"-stream-interval-{args.stream_interval}"
        title += f", stream_interval {args.stream_interval}"
    doc_dir = (args.output.parent if args.output else Path("."))
    img_dir = args.img_dir or doc_dir / "img" / ("" if section == "serve" else section)
    images = serve_report.plot(summaries, modes, slo, img_dir)
    say(f"plots written to {img_dir}")
    body = serve_report.markdown(setup, summaries, modes, images, doc_dir, times, rounds,
                                 split)
    publish(body, args.output, section, title, say)
    if args.json:
        args.json.write_text(json.dumps({"setup": asdict(setup),
                                         "summaries": [asdict(s) for s in summaries]},
                                        indent=1, default=str))
    return 0

"""`triton-disagg bench prefix`: prefix caching and KV-aware routing on shared-prefix, chat
and unshared traffic (issue 29).

Per mode (a router for the context pool, every server's cache on or off), cold
servers and a scheduler start (:mod:`.prefix_servers`); each workload
(:mod:`.prefix_workloads`; a seed of its own, the same in every mode) is sent over the
scheduler's OpenAI front as token-id completions, streamed and greedy, in waves, each wave
at ``--rate`` requests/s (Poisson); chat's ask for the generated ids too (``logprobs`` 0,
``return_tokens_as_token_ids``), which its next wave's prompts hold. Then the same again
with each context server's pool holding about half of the working set (shared and chat,
cache modes only).

Figures per run: prompt tokens prefilled (with the cache on, the servers' own counters,
``disagg_prefix_cache_prefilled_total`` summed over the context servers and generation,
and generation's apart: it prefills a prompt itself when at most ``--max-local-prefill`` of
its tokens are not in its cache, so the context router never sees it; with the cache off,
every prompt token once), hit rate against one never-evicting
cache (:func:`~.prefix_workloads.ideal_hit_tokens`), TTFT p50/p90 measured by the client
from send to first token (queueing, routing, prefill, KV handoff and the first decode),
goodput (requests/s that got their first token within ``--slo-ms``), errors, and whether
the greedy texts, and the prompts sent (chat's hold the answers), equal the first mode's.
The table is printed and, with ``--output``, kept as the ``prefix`` section of that file.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from triton_disagg.bench.args import add_engine_arg, bench_engine
from triton_disagg.bench.prefix_servers import RoutingSetup
from triton_disagg.bench.prefix_workloads import WORKLOADS, Answer, PrefixRequest, Shape
from triton_disagg.bench.report import progress, publish
from triton_disagg.errors import UserError

MODES = {m.name: m for m in (RoutingSetup("round_robin", "round_robin", False),
                             RoutingSetup("least_loaded", "least_loaded", False),
                             RoutingSetup("round_robin+cache", "round_robin", True),
                             RoutingSetup("least_loaded+cache", "least_loaded", True),
                             RoutingSetup("kv_aware", "kv_aware", True))}
PREFILLED = "disagg_prefix_cache_prefilled_total"  # prompt tokens computed, per instance
QUERIED = "disagg_prefix_cache_queries_total"     # prompt tokens looked up (fetched ones too)
MAX_LOCAL_PREFILL = 256    # generation_server.max_local_prefill_length: a chat turn's delta
HALF_POOL_WORKLOADS = ("shared", "chat")
ANSWERED = ("chat",)       # workloads whose next wave holds the answers: sent asking for ids


@dataclass(frozen=True)
class Run:
    mode: str
    workload: str
    pool: str                  # "full" | "half"
    prompt_tokens: int
    prefilled: int             # by the servers' counters (cache off: every prompt token)
    by_generation: int | None  # of which generation prefilled itself; None: cache off
    ideal_hits: int
    ttft: list[float]          # seconds, requests that got a first token
    goodput: float             # requests/s with TTFT <= the SLO
    errors: int
    texts: list[str]
    prompts: list[tuple[int, ...]]   # as sent: chat's hold the answers of this mode

    @property
    def hit_rate(self) -> float | None:
        """Tokens served from cache over what one infinite cache would have served."""
        return (self.prompt_tokens - self.prefilled) / self.ideal_hits if self.ideal_hits \
            else None


def add_prefix_parser(kinds) -> None:
    p = kinds.add_parser(
        "prefix", help="prefix caching and KV-aware routing: two context servers, one "
                       "generation server, shared-prefix / chat / unshared traffic",
        description=__doc__.split("\n\n")[1])
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, of {', '.join(MODES)} (default all)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--rate", type=float, default=2.0, help="requests/s within a wave (default 2)")
    p.add_argument("--slo-ms", type=float, default=1000.0, help="TTFT SLO for goodput")
    p.add_argument("--no-half-pool", action="store_true",
                   help="skip the runs with half the working set per context pool")
    p.add_argument("--max-local-prefill", type=int, default=MAX_LOCAL_PREFILL,
                   help="generation_server.max_local_prefill_length: a prompt with at most "
                        "this many tokens not in generation's cache is prefilled there, "
                        f"without a context (default {MAX_LOCAL_PREFILL}: a chat turn's "
                        "new message, and the end of the answer before it that fills no "
                        "whole block; 0: never)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every length of the workloads and --max-local-prefill "
                        "(e.g. 0.25 for a quick look)")
    add_engine_arg(p, "work/bench")
    p.add_argument("--work-dir", type=Path, default=Path("work/prefix"))
    p.add_argument("--output", type=Path, help="markdown file whose prefix section is replaced")
    p.set_defaults(func=run)


_say = progress("prefix")


def _names(text: str, known, flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or set(names) - set(known):
        raise UserError(f"{flag}: {text!r}; choose from {', '.join(known)}")
    return names


def scaled(shape: Shape, factor: float) -> Shape:
    if factor <= 0:
        raise UserError(f"--scale: {factor} must be more than 0")
    lengths = ("prefix_len", "suffix_len", "system_len", "message_len", "output_len")
    return Shape(**{**shape.__dict__, **{k: max(1, round(getattr(shape, k) * factor))
                                         for k in lengths}})


def run(args: argparse.Namespace) -> int:
    from triton_disagg.bench.prefix_servers import deployment
    from triton_disagg.engine.spec import EngineSpec

    modes = [MODES[n] for n in _names(args.modes, MODES, "--modes")]
    workloads = _names(args.workloads, WORKLOADS, "--workloads")
    if args.rate <= 0:
        raise UserError(f"--rate: {args.rate} must be more than 0 requests/s")
    if args.max_local_prefill < 0:
        raise UserError(f"--max-local-prefill: {args.max_local_prefill} must be 0 or more")
    engine = bench_engine(args.engine, args.work_dir, _say)
    spec, shape = EngineSpec.load(engine), scaled(Shape(), args.scale)
    runs: list[Run] = []
    deployed = deployment(engine, args.work_dir / "servers", _say,
                          round(args.max_local_prefill * args.scale))
    for pool in ("full",) if args.no_half_pool else ("full", "half"):
        for mode in modes:
            if pool == "half" and not mode.prefix_caching:
                continue
            chosen = [w for w in workloads if pool == "full" or w in HALF_POOL_WORKLOADS]
            runs += _mode_runs(deployed, mode, pool, chosen, shape, spec, args)
    table = markdown(runs, args)
    publish(table, args.output, "prefix", "Prefix caching and KV-aware routing", _say)
    return 0


def _mode_runs(deployed, mode: RoutingSetup, pool: str, workloads: list[str], shape: Shape, spec,
               args: argparse.Namespace) -> list[Run]:
    from triton_disagg.bench.prefix_workloads import rehearsed, working_set_blocks

    bs, block_bytes = spec.kv.tokens_per_block, spec.block_geometry().block_nbytes
    largest = max(working_set_blocks([r for r, _ in rehearsed(
        w, shape, spec.shape.vocab_size, WORKLOADS.index(w), _stand_in)], bs) for w in workloads)
    kv_bytes = (largest // 2 if pool == "half" else 2 * largest) * block_bytes
    with deployed.mode(mode, kv_bytes) as running:
        return [_one_run(running, mode, pool, w, shape, spec.shape.vocab_size, bs, args)
                for w in workloads]


def _stand_in(request: PrefixRequest) -> Answer:
    """An answer of the request's length, to size the pools before the servers answer:
    the blocks after a conversation's own tokens are its own, whatever they hold."""
    return (0,) * request.max_tokens


def _one_run(running, mode: RoutingSetup, pool: str, workload: str, shape: Shape,
             vocab_size: int, bs: int, args: argparse.Namespace) -> Run:
    """``workload``'s waves, each built from the last one's answers (chat's), sent in turn."""
    from triton_disagg.bench.prefix_workloads import ideal_hit_tokens, wave
    from triton_disagg.clients.load import run_openai_load
    from triton_disagg.clients.stream import GenerateRequest
    from triton_disagg.routing.scrape import delta, scrape

    _say(f"{mode.name}, {workload}, {pool} pool")
    before = [scrape(url) for url in running.metrics]
    answered: list[tuple[PrefixRequest, Answer]] = []
    outcomes, seconds, last, k = [], 0.0, [], 0
    while requests := wave(workload, shape, vocab_size, WORKLOADS.index(workload), k, last):
        sent = [GenerateRequest(r.prompt, r.max_tokens, options={"end_id": -1},
                                token_ids=workload in ANSWERED) for r in requests]
        load = run_openai_load(running.front, running.model, sent, args.rate, seed=k)
        last = [(r, tuple(o.measurement.token_ids) if o.measurement else ())
                for r, o in zip(requests, load.outcomes)]
        answered += last
        outcomes += load.outcomes
        seconds += load.duration
        k += 1
    prompt_tokens = sum(len(r.prompt) for r, _ in answered)
    prefilled, by_generation = prompt_tokens, None
    if mode.prefix_caching:
        after = _settled(running.metrics)
        counted = [int(delta(b, a, PREFILLED)) for b, a in zip(before, after)]
        prefilled, by_generation = sum(counted), counted[-1]   # generation's: the last
    ttft = [o.measurement.ttft for o in outcomes if o.measurement and o.measurement.ttft]
    good = sum(t <= args.slo_ms / 1000 for t in ttft)
    return Run(mode.name, workload, pool, prompt_tokens, prefilled, by_generation,
               sum(ideal_hit_tokens(answered, bs)), ttft, good / seconds if seconds else 0.0,
               sum(o.error is not None for o in outcomes),
               ["".join(o.measurement.text) if o.measurement else "" for o in outcomes],
               [r.prompt for r, _ in answered])


def _settled(urls: tuple[str, ...], period: float = 1.0, timeout: float = 15.0) -> list:
    """The servers' metrics once their prefix counters stop moving: every request has
    answered, so its lookups are made, but the servers publish them every half second, and
    a read at the last answer could miss the last requests and give them to the next run.
    Settled: two reads ``period`` (two publishing intervals) apart that agree."""
    import time

    from triton_disagg.routing.scrape import scrape, total

    def counts(samples: list) -> list[float]:
        return [total(s, name) for s in samples for name in (PREFILLED, QUERIED)]

    deadline = time.monotonic() + timeout
    last = [scrape(url) for url in urls]
    while True:
        time.sleep(period)
        after = [scrape(url) for url in urls]
        if counts(after) == counts(last) or time.monotonic() > deadline:
            return after
        last = after


def markdown(runs: list[Run], args: argparse.Namespace) -> str:
    lines = [f"`triton-disagg bench prefix --rate {args.rate:g} --slo-ms {args.slo_ms:g} "
             f"--max-local-prefill {args.max_local_prefill}"
             f"{f' --scale {args.scale:g}' if args.scale != 1 else ''}`: two context servers "
             f"and one generation server (the guide's `serve` commands, one host), token-id "
             f"completions over the scheduler's OpenAI front. Every server's prefix cache is "
             f"the mode's; generation prefills a prompt itself when at most "
             f"{round(args.max_local_prefill * args.scale)} of its tokens are not in its cache "
             f"(`generation_server.max_local_prefill_length`). Prefilled: every prompt token "
             f"computed, by the context servers and generation (their "
             f"`{PREFILLED}`); by generation: those it prefilled itself, which no context "
             f"router saw (cache off: not counted). TTFT is the client's, send to first token. A chat turn's prompt "
             f"holds the ids the server answered the turn before: prompts = first says the "
             f"mode sent the first mode's prompts (its answers were the same).", ""]
    for workload in dict.fromkeys(r.workload for r in runs):
        for pool in dict.fromkeys(r.pool for r in runs if r.workload == workload):
            rows = [r for r in runs if r.workload == workload and r.pool == pool]
            base = rows[0]
            lines += [f"**{workload}**, {pool} context pools ({base.prompt_tokens} prompt "
                      f"tokens; one infinite cache would serve {base.ideal_hits}):", "",
                      "| mode | prefilled | by generation | x fewer | hit rate | TTFT p50 ms "
                      "| TTFT p90 ms "
                      "| goodput req/s | errors | texts = first | prompts = first |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in rows:
                p50, p90 = (np.percentile(r.ttft, [50, 90]) * 1000 if r.ttft
                            else (float("nan"),) * 2)
                rate = "-" if r.hit_rate is None else f"{r.hit_rate:.2f}"
                own = "-" if r.by_generation is None else r.by_generation
                lines.append(f"| {r.mode} | {r.prefilled} | {own} | "
                             f"{base.prefilled / max(1, r.prefilled):.1f} | {rate} | "
                             f"{p50:.0f} | {p90:.0f} | {r.goodput:.2f} | {r.errors} | "
                             f"{'yes' if r.texts == base.texts else 'NO'} | "
                             f"{'yes' if r.prompts == base.prompts else 'NO'} |")
            lines.append("")
    return "\n".join(lines)

"""`triton-disagg bench prefix`: prefix caching and KV-aware routing on shared-prefix, chat
and unshared traffic (issue 29).

Per mode (a router for the context pool, every server's cache on or off), cold
servers and a scheduler start (:mod:`.prefix_servers`) and are warmed up with
``WARM_UP`` prompts no run sends; each workload
(:mod:`.prefix_workloads`; a seed of its own, the same in every mode) is sent over the
scheduler's OpenAI front as token-id completions, streamed and greedy, in waves, each wave
at ``--rate`` requests/s (Poisson); chat's ask for the generated ids too (``logprobs`` 0,
``return_tokens_as_token_ids``), which its next wave's prompts hold. Then the same again
with each context server's pool holding about half of the working set (shared and chat,
cache modes only). The control, unique, is sent ``--control-passes`` times per mode, each
pass with prompts of its own, and the pass with the lowest TTFT p50 is reported: a shared
machine's noise between two runs exceeds the 5% the control judges.

The routers are compared with generation's local prefill off (``max_local_prefill_length``
0, the default): with one generation server whose own cache holds a shared prefix or a
conversation, a prompt with at most that many tokens not in generation's cache is prefilled
there and no context router ever sees it, so every router would look alike. One more row
per workload that shares (``kv_aware+local_prefill``, full pools) runs kv_aware with
generation's local prefill at ``--local-prefill`` tokens, to show what it does.

Figures per run: prompt tokens prefilled (with the cache on, the servers' own counters,
``disagg_prefix_cache_prefilled_total`` summed over the context servers and generation,
and generation's apart: the prompts it prefilled itself; with the cache off, every prompt
token once), hit rate against one never-evicting
cache (:func:`~.prefix_workloads.ideal_hit_tokens`), TTFT p50/p90 measured by the client
from send to first token (queueing, routing, prefill, KV handoff and the first decode),
goodput (requests/s that got their first token within ``--slo-ms``), errors, and whether
the greedy texts, and the prompts sent (chat's hold the answers), equal the first mode's.
The table is printed and, with ``--output``, kept as the ``prefix`` section of that file.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from triton_disagg.bench.args import add_engine_arg, bench_engine
from triton_disagg.bench.prefix_servers import RoutingSetup
from triton_disagg.bench.prefix_workloads import WORKLOADS, Answer, PrefixRequest, Shape
from triton_disagg.bench.report import progress, publish
from triton_disagg.errors import UserError

if TYPE_CHECKING:
    from triton_disagg.clients.stream import GenerateRequest

MODES = {m.name: m for m in (RoutingSetup("round_robin", "round_robin", False),
                             RoutingSetup("least_loaded", "least_loaded", False),
                             RoutingSetup("round_robin+cache", "round_robin", True),
                             RoutingSetup("least_loaded+cache", "least_loaded", True),
                             RoutingSetup("kv_aware", "kv_aware", True),
                             RoutingSetup("kv_aware+local_prefill", "kv_aware", True,
                                          local_prefill=True))}
PREFILLED = "disagg_prefix_cache_prefilled_total"  # prompt tokens computed, per instance
QUERIED = "disagg_prefix_cache_queries_total"     # prompt tokens looked up (fetched ones too)
LOCAL_PREFILL = 256        # kv_aware+local_prefill's max_local_prefill_length: a chat turn's delta
SHARING_WORKLOADS = ("shared", "chat")   # also run in half pools and with local prefill
CONTROL = "unique"         # sent --control-passes times per mode, the best pass reported
CONTROL_PASSES = 5         # near load one pass's p50 moves by 10-30% between passes
ANSWERED = ("chat",)       # workloads whose next wave holds the answers: sent asking for ids
RATE = 3.0                 # requests/s: loads the cache-off pool, so the routers' tails differ
WARM_UP = 4                # unshared prompts sent at once before a mode's first run
WARM_SEED = -1             # the warm-up's prompts: a seed no run uses (run_seed's are >= 0)


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
    texts: list[str]                 # the control's: of every pass, in pass order
    prompts: list[tuple[int, ...]]   # as sent: chat's hold the answers of this mode

    @property
    def ttft_p50(self) -> float:
        return float(np.percentile(self.ttft, 50)) if self.ttft else float("inf")

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
    p.add_argument("--rate", type=float, default=RATE,
                   help=f"requests/s within a wave (default {RATE:g}: enough to load the "
                        "context pool without a cache, about twice one prefill's TTFT)")
    p.add_argument("--slo-ms", type=float, default=1000.0, help="TTFT SLO for goodput")
    p.add_argument("--no-half-pool", action="store_true",
                   help="skip the runs with half the working set per context pool")
    p.add_argument("--local-prefill", type=int, default=LOCAL_PREFILL,
                   help="kv_aware+local_prefill's generation_server.max_local_prefill_length "
                        "(every other mode: 0): a prompt with at most this many tokens not "
                        "in generation's cache is prefilled there, without a context (default "
                        f"{LOCAL_PREFILL}: a chat turn's new message, and the end of the "
                        "answer before it that fills no whole block)")
    p.add_argument("--control-passes", type=int, default=CONTROL_PASSES,
                   help=f"send {CONTROL} this many times per mode, each pass with prompts of "
                        "its own, and report the pass with the lowest TTFT p50 (default "
                        f"{CONTROL_PASSES})")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every length of the workloads and --local-prefill "
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


def planned(modes: list[RoutingSetup], workloads: list[str],
            half_pool: bool) -> list[tuple[str, RoutingSetup, list[str]]]:
    """(pool, mode, its workloads) in run order: every mode in full pools; with
    ``half_pool`` the cache modes again in half pools, on the workloads that share; the
    local prefill row on the workloads that share (unique has no cached part for it to
    prefill), in full pools."""
    plan = []
    for pool in ("full", "half") if half_pool else ("full",):
        for mode in modes:
            if pool == "half" and (not mode.prefix_caching or mode.local_prefill):
                continue
            sharing_only = pool == "half" or mode.local_prefill
            chosen = [w for w in workloads if not sharing_only or w in SHARING_WORKLOADS]
            if chosen:
                plan.append((pool, mode, chosen))
    return plan


def local_prefill_tokens(mode: RoutingSetup, args: argparse.Namespace) -> int:
    """``mode``'s generation_server.max_local_prefill_length: 0 (off) but for the local
    prefill row, whose ``--local-prefill`` scales with the workloads."""
    return round(args.local_prefill * args.scale) if mode.local_prefill else 0


def row_label(mode: RoutingSetup, local_prefill: int) -> str:
    return f"{mode.router}, local prefill {local_prefill}" if mode.local_prefill else mode.name


def run(args: argparse.Namespace) -> int:
    from triton_disagg.bench.prefix_servers import deployment
    from triton_disagg.engine.spec import EngineSpec

    modes = [MODES[n] for n in _names(args.modes, MODES, "--modes")]
    workloads = _names(args.workloads, WORKLOADS, "--workloads")
    if args.rate <= 0:
        raise UserError(f"--rate: {args.rate} must be more than 0 requests/s")
    if args.local_prefill < 1:
        raise UserError(f"--local-prefill: {args.local_prefill} must be 1 or more tokens")
    if args.control_passes < 1:
        raise UserError(f"--control-passes: {args.control_passes} must be 1 or more")
    engine = bench_engine(args.engine, args.work_dir, _say)
    spec, shape = EngineSpec.load(engine), scaled(Shape(), args.scale)
    runs: list[Run] = []
    deployed = deployment(engine, args.work_dir / "servers", _say)
    for pool, mode, chosen in planned(modes, workloads, not args.no_half_pool):
        runs += _mode_runs(deployed, mode, pool, chosen, shape, spec, args)
    table = markdown(runs, args)
    publish(table, args.output, "prefix", "Prefix caching and KV-aware routing", _say)
    return 0


def _mode_runs(deployed, mode: RoutingSetup, pool: str, workloads: list[str], shape: Shape, spec,
               args: argparse.Namespace) -> list[Run]:
    from triton_disagg.bench.prefix_workloads import rehearsed, working_set_blocks

    bs, block_bytes = spec.kv.tokens_per_block, spec.block_geometry().block_nbytes
    largest = max(working_set_blocks([r for r, _ in rehearsed(
        w, shape, spec.shape.vocab_size, run_seed(w, 0), _stand_in)], bs) for w in workloads)
    kv_bytes = (largest // 2 if pool == "half" else 2 * largest) * block_bytes
    local_prefill = local_prefill_tokens(mode, args)
    with deployed.mode(mode, kv_bytes, local_prefill) as running:
        _warm_up(running, shape, spec.shape.vocab_size)

        def one(workload: str, seed: int) -> Run:
            return _one_run(running, row_label(mode, local_prefill), mode.prefix_caching, pool,
                            workload, seed, shape, spec.shape.vocab_size, bs, args)

        return [best_pass([one(w, run_seed(w, k))
                           for k in range(args.control_passes if w == CONTROL else 1)])
                for w in workloads]


def run_seed(workload: str, k: int) -> int:
    """The seed of ``workload``'s pass ``k``: the same in every mode, another per workload
    and pass (passes past the first: the control's)."""
    return WORKLOADS.index(workload) + len(WORKLOADS) * k


def as_sent(requests: list[PrefixRequest], token_ids: bool = False) -> list[GenerateRequest]:
    """``requests`` as the client sends them: greedy to ``max_tokens`` (no end id), asking
    for the generated ids when ``token_ids``."""
    from triton_disagg.clients.stream import GenerateRequest

    return [GenerateRequest(r.prompt, r.max_tokens, options={"end_id": -1}, token_ids=token_ids)
            for r in requests]


def warm_up_requests(shape: Shape, vocab_size: int) -> list[PrefixRequest]:
    """The first ``WARM_UP`` of the control's prompts of ``WARM_SEED``: no block of theirs
    is a block of a run's prompt, so they warm the servers without warming a cache."""
    from triton_disagg.bench.prefix_workloads import wave

    return wave(CONTROL, shape, vocab_size, WARM_SEED, 0)[:WARM_UP]


def _warm_up(running, shape: Shape, vocab_size: int) -> None:
    """Sends :func:`warm_up_requests` all at once and waits for their answers, so that each
    server's first prefill, KV read and decode step (its allocations, NIXL connections,
    ZeroMQ sockets) are not timed: every router spreads concurrent prompts no server holds
    over both context servers. The runs count from their own start (the servers' counters as
    deltas, their own TTFTs); in a cache mode the warm-up's blocks are the pool's least
    recently used, the first a run's allocations evict."""
    from triton_disagg.clients.load import run_openai_load

    sent = as_sent(warm_up_requests(shape, vocab_size))
    load = run_openai_load(running.front, running.model, sent, rate=1000.0)
    failed = [o.error for o in load.outcomes if o.error is not None]
    _say(f"warmed up: {len(sent) - len(failed)} of {len(sent)} answered"
         + (f"; first failure: {failed[0]}" if failed else ""))


def best_pass(passes: list[Run]) -> Run:
    """The pass with the lowest TTFT p50, with the texts and prompts of every pass (in
    pass order: the greedy check covers them all)."""
    best = min(passes, key=lambda r: r.ttft_p50)
    return replace(best, texts=[t for r in passes for t in r.texts],
                   prompts=[p for r in passes for p in r.prompts])


def _stand_in(request: PrefixRequest) -> Answer:
    """An answer of the request's length, to size the pools before the servers answer:
    the blocks after a conversation's own tokens are its own, whatever they hold."""
    return (0,) * request.max_tokens


def _one_run(running, label: str, prefix_caching: bool, pool: str, workload: str, seed: int,
             shape: Shape, vocab_size: int, bs: int, args: argparse.Namespace) -> Run:
    """``workload``'s waves (of ``seed``), each built from the last one's answers (chat's),
    sent in turn."""
    from triton_disagg.bench.prefix_workloads import ideal_hit_tokens, wave
    from triton_disagg.clients.load import run_openai_load
    from triton_disagg.routing.scrape import delta, scrape

    _say(f"{label}, {workload} (seed {seed}), {pool} pool")
    before = [scrape(url) for url in running.metrics]
    answered: list[tuple[PrefixRequest, Answer]] = []
    outcomes, seconds, last, k = [], 0.0, [], 0
    while requests := wave(workload, shape, vocab_size, seed, k, last):
        load = run_openai_load(running.front, running.model,
                               as_sent(requests, token_ids=workload in ANSWERED), args.rate, seed=k)
        last = [(r, tuple(o.measurement.token_ids) if o.measurement else ())
                for r, o in zip(requests, load.outcomes)]
        answered += last
        outcomes += load.outcomes
        seconds += load.duration
        k += 1
    prompt_tokens = sum(len(r.prompt) for r, _ in answered)
    prefilled, by_generation = prompt_tokens, None
    if prefix_caching:
        after = _settled(running.metrics)
        counted = [int(delta(b, a, PREFILLED)) for b, a in zip(before, after)]
        prefilled, by_generation = sum(counted), counted[-1]   # generation's: the last
    ttft = [o.measurement.ttft for o in outcomes if o.measurement and o.measurement.ttft]
    good = sum(t <= args.slo_ms / 1000 for t in ttft)
    return Run(label, workload, pool, prompt_tokens, prefilled, by_generation,
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
    local, passes = round(args.local_prefill * args.scale), args.control_passes
    lines = [f"`triton-disagg bench prefix --rate {args.rate:g} --slo-ms {args.slo_ms:g} "
             f"--local-prefill {args.local_prefill} --control-passes {passes}"
             f"{f' --scale {args.scale:g}' if args.scale != 1 else ''}`: two context servers "
             f"and one generation server (the guide's `serve` commands, one host), token-id "
             f"completions over the scheduler's OpenAI front. Every server's prefix cache is "
             f"the mode's. The routers are compared with generation's local prefill off "
             f"(`generation_server.max_local_prefill_length` 0, the default): with one "
             f"generation server whose own cache holds the shared prefix or the conversation, "
             f"a prompt with at most {local} tokens not in that cache is prefilled by "
             f"generation and no context router sees it, so every router would look alike. "
             f"The row `kv_aware, local prefill {local}` (full pools) runs kv_aware with it "
             f"on, to show what it does. Prefilled: every prompt token computed, by the "
             f"context servers and generation (their `{PREFILLED}`); by generation: those it "
             f"prefilled itself (cache off: not counted). TTFT is the client's, send to first "
             f"token. A chat turn's prompt holds the ids the server answered the turn before: "
             f"prompts = first says the mode sent the first mode's prompts (its answers were "
             f"the same). The control, {CONTROL}: {passes} passes per mode, each with prompts "
             f"of its own, the one with the lowest TTFT p50 shown (texts = first covers "
             f"every pass).", ""]
    for workload in dict.fromkeys(r.workload for r in runs):
        for pool in dict.fromkeys(r.pool for r in runs if r.workload == workload):
            rows = [r for r in runs if r.workload == workload and r.pool == pool]
            base = rows[0]
            lines += [f"**{workload}**, {pool} context pools ({base.prompt_tokens} prompt "
                      f"tokens; one infinite cache would serve {base.ideal_hits}"
                      f"{f'; best of {passes} passes' if workload == CONTROL else ''}):", "",
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

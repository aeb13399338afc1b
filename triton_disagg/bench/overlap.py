"""`triton-disagg bench overlap`: time to the second token of long prompts with
``--overlap_kv_transfer`` against without, in one run.

Two deployments of one engine run side by side, placed alike (context and front end on
the first half of ``--cpus``, generation on the rest), one with
``kv_cache.overlap_transfer``: by default two ``serve all`` on this host; with
``--link-mbit N`` the guide's three ``serve`` commands each, across two hosts joined by a
link of N Mbit/s (:mod:`.overlap_link`: network namespaces, root only), context on one,
generation and the scheduler on the other. They take turns, one request at a time, so
only one is busy at any moment. Each request streams ``max_tokens`` 2: its first token
comes from the context, its second from generation's first decode step, so the
first-to-second-token gap is the part of the KV handoff the client waits for (the handoff
window). Per prompt length and deployment: the median over ``--requests`` requests of one
round, best of ``--rounds`` rounds, after one warm-up request of ``TEXT_TOKENS`` tokens.
Long prompts need a long engine: without ``--engine`` the demo checkpoint is built with
``max_position_embeddings`` and ``max_seq_len`` of the longest prompt (rounded up to
1,024) plus room for the output.

Invariants: every figure is client-side (:mod:`.second_token`: from the request's send to
its first and second responses), so it includes the front end, both Triton hops and the
token path; the two deployments' rows come from the same rounds; every request's greedy
text is the same with and without overlap, or the bench fails saying where.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from triton_disagg.bench.args import cpus_arg, number_list
from triton_disagg.bench.report import progress, publish
from triton_disagg.errors import UserError

KV_MAX_SIZE = "160MB"      # per pool: an 8,192-token sequence of the demo engine is 32 MiB
STALL_SECONDS = 300.0      # a call's deadline: a long CPU prefill on a loaded host
MODES = ("without", "with")
TEXT_TOKENS = 16           # the warm-up request's max_tokens: a longer text to compare
TARGET_RATIO = 0.8         # issue 20: the second token >= 20% sooner with overlap


def add_overlap_parser(kinds) -> None:
    p = kinds.add_parser(
        "overlap", help="time to the second token of long prompts with --overlap_kv_transfer "
                        "against without, same run")
    p.add_argument("--engine", type=Path, help="engine directory (default: the demo engine, "
                                               "built long enough under --work-dir)")
    p.add_argument("--prompt-tokens", default="2000,8000", help="comma-separated lengths")
    p.add_argument("--requests", type=int, default=5, help="per length, server and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the best median is kept")
    p.add_argument("--cpus", default="0,1", help="context on the first half, generation on "
                                                 "the rest (default 0,1)")
    p.add_argument("--runtime", default="torch", choices=["torch", "numpy"],
                   help="model.runtime on the CPU (default torch: its prefill of 8,000 tokens "
                        "takes ~4 s on one core, numpy's ~30 s)")
    p.add_argument("--link-mbit", metavar="200,1000",
                   help="context on one host, generation and the scheduler on another "
                        "(network namespaces; root), what the context sends shaped to each "
                        "of these Mbit/s in turn (default: two serve all on this host)")
    p.add_argument("--work-dir", type=Path, default=Path("work/bench"))
    p.add_argument("--output", type=Path, help="markdown file whose overlap (or, with "
                                               "--link-mbit, overlap-link) section is replaced")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class Timing:
    """Medians over one round's requests, seconds from the send."""

    first: float
    second: float

    @property
    def window(self) -> float:
        return self.second - self.first


@dataclass(frozen=True)
class Row:
    tokens: int
    without: Timing
    with_: Timing
    link_mbit: float | None = None      # None: one host
    paired: tuple[float, ...] = ()      # each round's with / without second token

    @property
    def paired_ratio(self) -> float:
        """Median over rounds of the with / without ratio within a round (same load)."""
        return statistics.median(self.paired)

    @property
    def link(self) -> str:
        return "one host" if self.link_mbit is None else f"{self.link_mbit:g} Mbit/s"

    @property
    def second_ratio(self) -> float:
        return self.with_.second / self.without.second

    @property
    def hidden(self) -> float:
        """Share of the handoff window that overlap took away."""
        return 1.0 - self.with_.window / self.without.window


def best(timings: Sequence[Timing]) -> Timing:
    """The round with the earliest median second token."""
    return min(timings, key=lambda t: t.second)


def long_engine(work_dir: Path, tokens: int, say) -> Path:
    """The demo engine with room for a ``tokens``-token prompt and its output."""
    from triton_disagg.builders.build import build_engine
    from triton_disagg.builders.demo import write_demo_checkpoint

    length = -(-(tokens + 64) // 1024) * 1024
    checkpoint = work_dir / "checkpoints" / f"demo-{length}"
    built = work_dir / "engines" / f"demo-{length}"
    write_demo_checkpoint(checkpoint, max_position_embeddings=length)
    build_engine(checkpoint, built, max_seq_len=length, progress=say)
    return built.resolve()


def timing(replies: Sequence) -> Timing:
    """Medians of :class:`~triton_disagg.bench.second_token.TimedReply` times."""
    return Timing(statistics.median(r.first for r in replies),
                  statistics.median(r.second for r in replies))


@contextlib.contextmanager
def one_host(engine: Path, cores: Sequence[int], work_dir: Path,
             runtime: str) -> Iterator[tuple]:
    """Two ``serve all`` on this host; yields ``({mode: gRPC url}, client)``."""
    from triton_disagg.bench.handoff import serving
    from triton_disagg.bench.second_token import replies

    with contextlib.ExitStack() as stack:
        urls = {kv_overlap: stack.enter_context(serving(
            "direct_transfer", engine, cores, work_dir, overlap=kv_overlap == "with",
            kv_max_size=KV_MAX_SIZE, stall_seconds=STALL_SECONDS, runtime=runtime))[2]
                for kv_overlap in MODES}
        yield urls, replies


def same_texts(tokens: int, by_mode: dict[str, list]) -> None:
    """UserError unless both modes' replies (to the same prompts) have the same texts."""
    for without, with_ in zip(by_mode["without"], by_mode["with"]):
        if without.text != with_.text:
            raise UserError(f"bench overlap: a {tokens}-token prompt's greedy text differs "
                            f"with overlap ({with_.text!r}) from without ({without.text!r})")


def measure(args: argparse.Namespace, prompts: dict[int, list[str]], urls: dict[str, str],
            client: Callable, say, link_mbit: float | None = None) -> list[Row]:
    """Warm-up (and text check) per length and mode, then ``args.rounds`` rounds, each
    request sent to the deployment without overlap then to the one with it (pairs, so that
    a slow moment of the host hits both); the rows of the best rounds.
    ``client(url, prompts, max_tokens)``: the replies; ``prompts[n]``: the warm-up prompt,
    then ``args.requests`` more."""
    found: dict[tuple[int, str], list[Timing]] = {}
    for n, texts in prompts.items():
        same_texts(n, {mode: client(urls[mode], texts[:1], TEXT_TOKENS) for mode in MODES})
    for round_ in range(args.rounds):
        for n, texts in prompts.items():
            got: dict[str, list] = {mode: [] for mode in MODES}
            for prompt in texts[1:]:
                pair = {mode: client(urls[mode], [prompt], 2) for mode in MODES}
                same_texts(n, pair)
                for mode in MODES:
                    got[mode] += pair[mode]
            for mode in MODES:
                t = timing(got[mode])
                found.setdefault((n, mode), []).append(t)
                say(f"round {round_ + 1}, {n} tokens, {mode} overlap: first "
                    f"{t.first * 1e3:.0f} ms, second {t.second * 1e3:.0f} ms "
                    f"(window {t.window * 1e3:.1f} ms)")
    return [Row(n, best(found[(n, "without")]), best(found[(n, "with")]), link_mbit,
                tuple(w.second / wo.second for wo, w in zip(found[(n, "without")],
                                                          found[(n, "with")])))
            for n in prompts]


def run(args: argparse.Namespace) -> int:
    from triton_disagg.bench.handoff import exact_prompt
    from triton_disagg.bench.overlap_link import linked, refusal
    from triton_disagg.front.tokenizer import Tokenizer

    if args.requests < 1 or args.rounds < 1:
        raise UserError("bench overlap: --requests and --rounds must be >= 1")
    lengths = number_list(args.prompt_tokens, "--prompt-tokens", int)
    cores = cpus_arg(args.cpus)
    rates = number_list(args.link_mbit, "--link-mbit") if args.link_mbit else []
    why = refusal() if rates else None
    if why:
        raise UserError(why)

    say = progress("overlap")

    engine = args.engine.resolve() if args.engine else long_engine(args.work_dir,
                                                                    max(lengths), say)
    tokenizer, rng = Tokenizer(engine), random.Random(0)
    prompts = {n: [exact_prompt(tokenizer, n, rng) for _ in range(args.requests + 1)]
               for n in lengths}
    started, rows, notes = time.monotonic(), [], []
    if rates:
        work = (args.work_dir / "overlap-link").resolve()
        with linked(engine, cores, work, MODES, say, KV_MAX_SIZE, STALL_SECONDS,
                    args.runtime) as (urls, client, link):
            for mbit in rates:
                link.shape(mbit)
                say(f"what the context host sends is shaped to {mbit:g} Mbit/s")
                before = link.sent()
                rows += measure(args, prompts, urls, client, say, mbit)
                notes.append(f"At {mbit:g} Mbit/s the hosts sent " + ", ".join(
                    f"{host} {(n - before[host]) / 1e6:.1f} MB"
                    for host, n in link.sent().items()) + " (both deployments, every request).")
                say(notes[-1])
    else:
        with one_host(engine, cores, (args.work_dir / "overlap").resolve(),
                      args.runtime) as (urls, client):
            rows = measure(args, prompts, urls, client, say)
    say(f"measured in {time.monotonic() - started:.0f} s")
    body = markdown(rows, args, notes)
    name, title = (("overlap-link", "KV transfer overlapped with the prefill, across a "
                                    "shaped link") if rates else
                   ("overlap", "KV transfer overlapped with the prefill"))
    publish(body, args.output, name, title, say)
    return 0


def markdown(rows: Sequence[Row], args: argparse.Namespace, notes: Sequence[str] = ()) -> str:
    """The section: what ran (its command line), a row per link rate and length, then
    ``notes`` (a paragraph each)."""
    where = ("two `serve all` of the demo engine on this host" if not args.link_mbit else
             "two deployments of the demo engine, each the guide's three `serve` commands "
             "across two hosts (network namespaces joined by a bridge, NIXL over UCX TCP): "
             "context on one, generation and the scheduler (and the client) on the other, "
             "what the context host sends shaped to the link rate by a `tc` token bucket")
    lines = [
        f"`triton-disagg bench overlap`: {where} ({args.runtime} runtime, direct_transfer, "
        f"cores {args.cpus}: "
        f"context and front end on the first half, generation on the rest), one with "
        f"`--overlap_kv_transfer`, taking turns one request at a time; max_tokens 2, streamed "
        f"over gRPC, each request to both in turn. Client-side medians of {args.requests} "
        f"requests per length and "
        f"deployment, best of {args.rounds} rounds after a warm-up request "
        f"(max_tokens {TEXT_TOKENS}); every reply's greedy text was the same with and "
        f"without overlap. The window is the first-to-second-token gap (the handoff the "
        f"client waits for); hidden is the share of that window overlap took away. "
        f"Paired: the with / without ratio of the second token within each round (both "
        f"deployments under the same load), its median in bold; the target is judged on "
        f"it.", "",
        f"Command: `{command_line(args)}`", "",
        "| link | prompt tokens | first token (without / with) | second token without | "
        "second token with | with / without | paired, per round | window without | "
        "window with | hidden |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.link} | {r.tokens:,} | {r.without.first * 1e3:.0f} / "
            f"{r.with_.first * 1e3:.0f} ms | {r.without.second * 1e3:.0f} ms | "
            f"{r.with_.second * 1e3:.0f} ms | {r.second_ratio:.3f} | "
            f"{' / '.join(f'{p:.2f}' for p in r.paired)} (**{r.paired_ratio:.3f}**) | "
            f"{r.without.window * 1e3:.1f} ms | {r.with_.window * 1e3:.1f} ms | "
            f"{r.hidden:.0%} |")
    return "\n\n".join(["\n".join(lines), verdict(rows), *notes]) + "\n"


def verdict(rows: Sequence[Row]) -> str:
    """Issue 20's target per row: the second token at most ``TARGET_RATIO`` of without's
    (the paired ratio's median)."""
    said = [f"{'holds' if r.paired_ratio <= TARGET_RATIO else 'MISSES'} at {r.link}, "
            f"{r.tokens:,} tokens ({r.paired_ratio:.3f})" for r in rows]
    return (f"Issue 20's target (time to second token >= {1 - TARGET_RATIO:.0%} lower with "
            f"overlap): {'; '.join(said)}.")


def command_line(args: argparse.Namespace) -> str:
    """The ``bench overlap`` command that reruns these figures (engine and paths aside)."""
    line = (f"triton-disagg bench overlap --prompt-tokens {args.prompt_tokens} --requests "
            f"{args.requests} --rounds {args.rounds} --cpus {args.cpus} --runtime {args.runtime}")
    return line + (f" --link-mbit {args.link_mbit}" if args.link_mbit else "")

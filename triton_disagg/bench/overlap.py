"""`triton-disagg bench overlap`: time to the second token of long prompts with
``--overlap_kv_transfer`` against without, in one run.

Two ``serve all`` servers of one engine run side by side, placed alike (context and front
end on the first half of ``--cpus``, generation on the rest), one with
``kv_cache.overlap_transfer``; they take turns, one request at a time, so only one is busy
at any moment. Each request streams ``max_tokens`` 2: its first token comes from the
context, its second from generation's first decode step, so the first-to-second-token gap
is the part of the KV handoff the client waits for (the handoff window). Per prompt length
and server: the median over ``--requests`` requests of one round, best of ``--rounds``
rounds (after one warm-up request each). Long prompts need a long engine: without
``--engine`` the demo checkpoint is built with ``max_position_embeddings`` and
``max_seq_len`` of the longest prompt (rounded up to 1,024) plus room for the output.

Invariant: every figure is client-side (``time.perf_counter``, from the request's send to
its first and second responses), so it includes the front end, both Triton hops and the
token path; the two servers' rows come from the same rounds; both servers answer every
prompt with the same text, or the bench fails.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from triton_disagg.bench.args import number_list
from triton_disagg.errors import UserError

KV_MAX_SIZE = "160MB"      # per pool: an 8,192-token sequence of the demo engine is 32 MiB
STALL_SECONDS = 300.0      # a call's deadline: a long CPU prefill on a loaded host
MODES = ("without", "with")


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
    p.add_argument("--work-dir", type=Path, default=Path("work/bench"))
    p.add_argument("--output", type=Path, help="markdown file whose overlap section is replaced")
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


async def _rounds(grpc: dict[str, str], prompts: dict[int, list[str]], rounds: int,
                  say) -> dict[tuple[int, str], list[Timing]]:
    """Every round: each length's requests, each sent to the server without overlap then
    to the one with it (pairs, so that a slow moment of the host hits both); per round and
    server, the medians. The first request of each length warms both servers up."""
    import tritonclient.grpc.aio as aio

    from triton_disagg.clients.stream import GenerateRequest, grpc_generate

    clients = {mode: aio.InferenceServerClient(url) for mode, url in grpc.items()}
    found: dict[tuple[int, str], list[Timing]] = {}
    try:
        async def one(mode: str, prompt: str) -> tuple[float, float, str]:
            m = await grpc_generate(clients[mode], GenerateRequest(prompt, 2))
            if len(m.arrivals) < 2:
                raise UserError("bench overlap: a reply came in one response; the second "
                                "token is needed (is stream_interval 1?)")
            return m.arrivals[0] - m.start, m.arrivals[1] - m.start, "".join(m.text)

        for n, texts in prompts.items():
            for mode in MODES:
                await one(mode, texts[0])
        for round_ in range(rounds):
            for n, texts in prompts.items():
                got: dict[str, list] = {mode: [] for mode in MODES}
                for prompt in texts[1:]:
                    pair = {mode: await one(mode, prompt) for mode in MODES}
                    if len({text for _, _, text in pair.values()}) != 1:
                        raise UserError(f"bench overlap: the servers answered a {n}-token "
                                        f"prompt differently: {pair}")
                    for mode in MODES:
                        got[mode].append(pair[mode])
                for mode in MODES:
                    t = Timing(statistics.median(f for f, _, _ in got[mode]),
                               statistics.median(s for _, s, _ in got[mode]))
                    found.setdefault((n, mode), []).append(t)
                    say(f"round {round_ + 1}, {n} tokens, {mode} overlap: first "
                        f"{t.first * 1e3:.0f} ms, second {t.second * 1e3:.0f} ms "
                        f"(window {t.window * 1e3:.1f} ms)")
    finally:
        for client in clients.values():
            await client.close()
    return found


def measure(args: argparse.Namespace, engine: Path, lengths: list[int], say) -> list[Row]:
    import contextlib

    from triton_disagg.bench.handoff import exact_prompt, serving
    from triton_disagg.engine.tokenizer import Tokenizer

    cores = number_list(args.cpus, "--cpus", int, allow_zero=True)
    tokenizer, rng = Tokenizer(engine), random.Random(0)
    prompts = {n: [exact_prompt(tokenizer, n, rng) for _ in range(args.requests + 1)]
               for n in lengths}
    with contextlib.ExitStack() as stack:
        grpc = {}
        for mode in MODES:
            say(f"starting serve all {mode} overlap")
            _, _, grpc[mode] = stack.enter_context(serving(
                "direct_transfer", engine, cores, (args.work_dir / "overlap").resolve(),
                overlap=mode == "with", kv_max_size=KV_MAX_SIZE, stall_seconds=STALL_SECONDS,
                runtime=args.runtime))
        found = asyncio.run(_rounds(grpc, prompts, args.rounds, say))
    return [Row(n, best(found[(n, "without")]), best(found[(n, "with")])) for n in lengths]


def run(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.rounds < 1:
        raise UserError("bench overlap: --requests and --rounds must be >= 1")
    lengths = number_list(args.prompt_tokens, "--prompt-tokens", int)

    def say(message: str) -> None:
        print(f"[bench overlap] {message}", file=sys.stderr, flush=True)

    engine = args.engine.resolve() if args.engine else long_engine(args.work_dir,
                                                                    max(lengths), say)
    started = time.monotonic()
    rows = measure(args, engine, lengths, say)
    say(f"measured in {time.monotonic() - started:.0f} s")
    body = markdown(rows, args)
    print(body)
    if args.output:
        from triton_disagg.bench.report import replace_section

        replace_section(args.output, "overlap", "KV transfer overlapped with the prefill", body)
        say(f"section written to {args.output}")
    return 0


def markdown(rows: Sequence[Row], args: argparse.Namespace) -> str:
    lines = [
        f"`triton-disagg bench overlap`: two `serve all` of the demo engine ({args.runtime} "
        f"runtime, direct_transfer, "
        f"cores {args.cpus}: context and front end on the first half, generation on the "
        f"rest), one with `--overlap_kv_transfer`, taking turns one request at a time; "
        f"max_tokens 2, streamed over gRPC. Client-side medians of {args.requests} requests "
        f"per length and server, best of {args.rounds} rounds after a warm-up request. The "
        f"window is the first-to-second-token gap (the handoff the client waits for); "
        f"hidden is the share of that window overlap took away.", "",
        "| prompt tokens | first token (without / with) | second token without | second "
        "token with | with / without | window without | window with | hidden |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.tokens:,} | {r.without.first * 1e3:.0f} / {r.with_.first * 1e3:.0f} ms | "
            f"{r.without.second * 1e3:.0f} ms | {r.with_.second * 1e3:.0f} ms | "
            f"{r.second_ratio:.3f} | {r.without.window * 1e3:.1f} ms | "
            f"{r.with_.window * 1e3:.1f} ms | {r.hidden:.0%} |")
    return "\n".join(lines) + "\n"

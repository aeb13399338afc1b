"""`triton-disagg bench remote`: what the remote path adds to TTFT over `serve all`.

Two deployments of one engine, up side by side on this host, on the same cores:

- ``serve all``: one tritonserver; the orchestrator reaches context and generation
  in-process (BLS), tokens over ipc;
- ``remote``: the three roles as the three `triton-disagg serve context|generation|
  scheduler` commands a user runs on three hosts, here on loopback: the scheduler reaches
  the others through gRPC (static ``urls``), the KV crosses by NIXL, tokens come back
  over tcp (CurveZMQ).

Context gets the first half of the cores, generation the second, in both. Each run sends
the same serial request set (one request at a time, so nothing queues) to each
deployment in turn, after ``WARMUP_REQUESTS`` each; ``--runs`` runs, and each
deployment's figure is its best (lowest) p50 over the runs. A TTFT is the client's:
from the gRPC stream's send to the first token's arrival (tokenizing in preprocessing
included; process start and the client's import not). The deployments idle while the
other is measured.

Invariant: every process this starts is stopped (SIGTERM, then SIGKILL of its process
group) before :func:`run` returns, even when a server fails to start.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from triton_disagg.bench.args import add_engine_arg, bench_engine, cpus_arg
from triton_disagg.bench.report import progress, publish, shown_path
from triton_disagg.config.roles import Role
from triton_disagg.errors import UserError
from triton_disagg.launch.process_group import terminate

WARMUP_REQUESTS = 4
STOP_SECONDS = 60.0
TARGET_MS = 5.0           # target: the remote path adds at most this much TTFT at p50


def add_remote_parser(kinds) -> None:
    p = kinds.add_parser(
        "remote", help="TTFT added by the remote path (scheduler -> gRPC -> context and "
                       "generation servers) over `serve all`, same engine and cores")
    add_engine_arg(p)
    p.add_argument("--requests", type=int, default=32, help="serial requests per run")
    p.add_argument("--runs", type=int, default=3, help="runs per deployment; the best p50 counts")
    p.add_argument("--prompt-tokens", default="uniform:32,128", help="length distribution")
    p.add_argument("--output-tokens", default="uniform:16,32", help="length distribution")
    p.add_argument("--cpus", help="cores, e.g. 0,1 (default: all usable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, default=Path("work/bench-remote"))
    p.add_argument("--output", type=Path, help="markdown file whose remote section is replaced")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from triton_disagg.bench.serve_cli import make_requests
    from triton_disagg.clients.load import run_load
    from triton_disagg.bench.serve_servers import serving
    from triton_disagg.front.tokenizer import Tokenizer

    if args.requests < 1 or args.runs < 1:
        raise UserError("--requests and --runs must be >= 1")
    cores = cpus_arg(args.cpus)

    say = progress("remote")

    began = time.monotonic()
    engine = bench_engine(args.engine, args.work_dir, say)
    tokenizer = Tokenizer(engine)
    requests = make_requests(args.requests, args, tokenizer, args.seed)
    work = args.work_dir.resolve()
    best: dict[str, dict[str, float]] = {}
    with contextlib.ExitStack() as stack:
        say(f"starting `serve all` and the three roles on cores {cores}")
        grpc = {"serve all": stack.enter_context(serving("disaggregated", engine, cores, work)).grpc,
                "remote": stack.enter_context(_three_roles(engine, cores, work / "remote", say))}
        for name, url in grpc.items():
            run_load(url, make_requests(WARMUP_REQUESTS, args, tokenizer, -1), math.inf)
        for i in range(args.runs):
            for name, url in grpc.items():
                load = run_load(url, requests, 0)
                errors = [o.error for o in load.outcomes if o.error]
                if errors:
                    raise UserError(f"bench remote: {name}: {len(errors)} request(s) failed: "
                                    f"{errors[0]}")
                done = [o.measurement for o in load.outcomes]
                figures = {"ttft": float(np.median([m.ttft for m in done])),
                           "tpot": float(np.median([m.tpot for m in done if m.tpot is not None]))}
                say(f"run {i + 1}/{args.runs} {name:>9}: TTFT p50 {figures['ttft'] * 1e3:.1f} ms, "
                    f"TPOT p50 {figures['tpot'] * 1e3:.2f} ms")
                if name not in best or figures["ttft"] < best[name]["ttft"]:
                    best[name] = figures
    body = markdown(best, args, cores, shown_path(engine), time.monotonic() - began)
    publish(body, args.output, "remote", "Remote path: scheduler over gRPC vs serve all", say)
    return 0


def markdown(best: dict[str, dict[str, float]], args: argparse.Namespace, cores: list[int],
             engine: str, seconds: float) -> str:
    added = (best["remote"]["ttft"] - best["serve all"]["ttft"]) * 1e3
    verdict = "holds" if added <= TARGET_MS else "misses"
    rows = "\n".join(f"| {name} | {f['ttft'] * 1e3:.1f} | {f['tpot'] * 1e3:.2f} |"
                     for name, f in best.items())
    return f"""`triton-disagg bench remote --requests {args.requests} --runs {args.runs}` on engine
`{engine}`, cores {cores} (context the first half, generation the second, in both
deployments), prompts `{args.prompt_tokens}` tokens, outputs `{args.output_tokens}`; run
took {seconds:.0f} s. One request at a time (nothing queues); each figure is the
deployment's best p50 over the runs, measured by the client from the gRPC stream's send
(tokenizing included; process start not). `remote` is the three `serve` commands of a
three-host deployment on loopback: scheduler -> gRPC -> context and generation, KV by
NIXL, tokens over tcp.

| deployment | TTFT p50 (ms) | TPOT p50 (ms) |
|---|---|---|
{rows}

TTFT added by the remote path: **{added:+.1f} ms** at p50 ({verdict} the <= {TARGET_MS:g} ms
target).
"""


@contextlib.contextmanager
def _three_roles(engine: Path, cores: list[int], work: Path, say) -> Iterator[str]:
    """The three roles' `serve` commands (:func:`serve_argv`, as every launcher writes them)
    on loopback, run by this interpreter; yields the scheduler's gRPC url."""
    from triton_disagg.bench.serve_servers import wait_ready
    from triton_disagg.bench.serve_servers import placement
    from triton_disagg.launch.deploy import free_ports
    from triton_disagg.launch.serve_argv import serve_argv

    ctx, gen, sched, *metrics = free_ports(6)
    roles = placement("disaggregated", cores)
    config = work / "disagg_config.yaml"
    work.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f"model: {{engine: \"{engine}\"}}\nmode: disaggregated\n"
        f"context_server: {{urls: [\"127.0.0.1:{ctx}\"], cpus: {roles['context_server']['cpus']}}}\n"
        f"generation_server: {{urls: [\"127.0.0.1:{gen}\"], "
        f"cpus: {roles['generation_server']['cpus']}}}\n"
        f"scheduler_server: {{cpus: {roles['scheduler_server']['cpus']}}}\n")
    ports = {"context": (ctx, metrics[0]), "generation": (gen, metrics[1]),
             "scheduler": (sched, metrics[2])}
    started: list[tuple[subprocess.Popen, Path]] = []
    try:
        for role, (grpc, metrics_port) in ports.items():
            log = work / f"{role}.log"
            argv = serve_argv(role, str(config), "127.0.0.1", grpc, metrics_port,
                              http_port=free_ports(1)[0] if role == Role.SCHEDULER else None,
                              front_port=free_ports(1)[0])
            cmd = [sys.executable, "-m", "triton_disagg.cli", *argv[1:],
                   "--work-dir", str(work / role)]
            with open(log, "wb") as out:
                started.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                 start_new_session=True), log))
        for proc, log in started:
            wait_ready(proc, log, f"bench remote: `{' '.join(proc.args[3:6])}`")
        say("the three roles are ready")
        yield f"127.0.0.1:{sched}"
    finally:
        for proc, _ in started:
            terminate(proc, STOP_SECONDS)


#!/usr/bin/env python3
"""What the public door (:mod:`triton_disagg.front.public_door`) costs a streamed request:
one ``triton-disagg serve all`` (demo engine unless ``--engine``), the same serial request
set (one at a time, nothing queues) sent by tritonclient gRPC streams to the ensemble
through the door (the public gRPC port) and straight to tritonserver's own loopback port,
after ``WARMUP`` requests each, the two paths taking turns every ``CHUNK`` requests (so a
busy moment of the host falls on both); ``--runs`` runs, each path's figures those of its
run with the best (lowest) p50 TTFT, as ``bench remote`` keeps them.

    .venv/bin/python scripts/door_cost.py [--engine DIR] [--requests 32] [--runs 3]

Prints a markdown table (docs/benchmarks.md, "The public door's cost"). Loopback only.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import numpy as np

from triton_disagg.bench.args import bench_engine
from triton_disagg.bench.serve_cli import make_requests
from triton_disagg.bench.serve_servers import serve_cli
from triton_disagg.clients.load import run_load
from triton_disagg.front.tokenizer import Tokenizer
from triton_disagg.launch.deploy import free_ports

WARMUP = 4
CHUNK = 16


def _inner_grpc(work_dir: Path) -> str:
    """tritonserver's own gRPC address, from its command line (``serve`` names it too)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if argv[0].endswith("/tritonserver") and str(work_dir) in " ".join(argv):
            flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
            return f"{flags['grpc-address']}:{flags['grpc-port']}"
    raise SystemExit(f"no tritonserver under {work_dir}")


def _one_run(urls: dict[str, str], requests: list) -> dict[str, dict[str, float]]:
    """Each path's p50 TTFT and per-token time and its tokens/s over ``requests``."""
    done: dict[str, list] = {name: [] for name in urls}
    seconds = dict.fromkeys(urls, 0.0)
    for first in range(0, len(requests), CHUNK):
        for name, url in urls.items():
            load = run_load(url, requests[first:first + CHUNK], 0)
            errors = [o.error for o in load.outcomes if o.error]
            if errors:
                raise SystemExit(f"{name}: {len(errors)} request(s) failed: {errors[0]}")
            done[name] += [o.measurement for o in load.outcomes]
            seconds[name] += load.duration
    return {name: {"ttft": float(np.median([m.ttft for m in ms])),
                   "tpot": float(np.median([m.tpot for m in ms if m.tpot is not None])),
                   "tokens_s": sum(m.output_tokens for m in ms) / seconds[name]}
            for name, ms in done.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--prompt-tokens", default="uniform:32,128")
    p.add_argument("--output-tokens", default="uniform:16,32")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="door-cost-"))
    engine = bench_engine(args.engine, Path("work/bench"), print)
    tokenizer = Tokenizer(engine)
    requests = make_requests(args.requests, args, tokenizer, 0)
    http, grpc, metrics, front = free_ports(4)
    serve = ["all", "--engine", str(engine), "--http-port", str(http), "--grpc-port", str(grpc),
             "--metrics-port", str(metrics), "--front-port", str(front),
             "--work-dir", str(work / "run")]
    best: dict[str, dict[str, float]] = {}
    with serve_cli(serve, work / "serve.log"):
        urls = {"through the door": f"127.0.0.1:{grpc}",
                "tritonserver's own port": _inner_grpc(work / "run")}
        for url in urls.values():
            run_load(url, make_requests(WARMUP, args, tokenizer, -1), math.inf)
        for run in range(args.runs):
            for name, f in _one_run(urls, requests).items():
                print(f"run {run + 1}/{args.runs} {name}: TTFT p50 {f['ttft'] * 1e3:.2f} ms, "
                      f"per token p50 {f['tpot'] * 1e3:.3f} ms, {f['tokens_s']:.0f} tokens/s",
                      flush=True)
                if name not in best or f["ttft"] < best[name]["ttft"]:
                    best[name] = f
    print("\n| path | TTFT p50 (ms) | per token p50 (ms) | tokens/s |\n|---|--:|--:|--:|")
    for name, f in best.items():
        print(f"| {name} | {f['ttft'] * 1e3:.2f} | {f['tpot'] * 1e3:.3f} | {f['tokens_s']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

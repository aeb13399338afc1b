"""`triton-disagg bench engine|serve|front|handoff|overlap|prefix|remote|soak|stall`: figures kept in
docs/benchmarks.md."""

from __future__ import annotations

import argparse
from pathlib import Path

from triton_disagg.bench.args import number_list
from triton_disagg.bench.front_bench import add_front_parser
from triton_disagg.bench.handoff import add_handoff_parser
from triton_disagg.bench.overlap import add_overlap_parser
from triton_disagg.bench.prefix_cli import add_prefix_parser
from triton_disagg.bench.remote_cli import add_remote_parser
from triton_disagg.bench.serve_cli import add_serve_parser
from triton_disagg.bench.soak_cli import add_soak_parser
from triton_disagg.bench.stall import add_stall_parser
from triton_disagg.errors import UserError


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks that print figures and keep them in docs/")
    kinds = bench.add_subparsers(dest="bench_kind", required=True, metavar="KIND")
    engine = kinds.add_parser(
        "engine", help="prefill/decode tokens/s of the engine's runtimes vs transformers, "
                       "and the roofline")
    engine.add_argument("--runtime", default="numpy,torch",
                        help="comma-separated runtimes to measure (default numpy,torch)")
    engine.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cpu (default); on a GPU run scripts/gpu_check.sh instead")
    engine.add_argument("--repeats", type=int, default=3,
                        help="timed passes per figure after one warm-up; the best is kept")
    engine.add_argument("--work-dir", type=Path, default=Path("work/bench"),
                        help="where the benchmark checkpoints and engines are built (kept between runs)")
    engine.add_argument("--batch-sizes", default="1,8,32", help="comma-separated (default 1,8,32)")
    engine.add_argument("--prompt-len", type=int, default=64)
    engine.add_argument("--new-tokens", type=int, default=32)
    engine.add_argument("--threads", type=int, default=None,
                        help="BLAS / torch threads for both implementations (default: all usable cores)")
    engine.add_argument("--models", default="demo,gpt2-small",
                        help="which of demo, gpt2-small to bench (default both)")
    engine.add_argument("--output", type=Path, default=None,
                        help="markdown file whose engine section is replaced with the table")
    engine.set_defaults(func=_run_engine)
    add_serve_parser(kinds)
    add_front_parser(kinds)
    add_handoff_parser(kinds)
    add_overlap_parser(kinds)
    add_prefix_parser(kinds)
    add_remote_parser(kinds)
    add_soak_parser(kinds)
    add_stall_parser(kinds)


def _prepare_models(names: list[str], work_dir: Path, say) -> dict[str, tuple[Path, Path]]:
    from triton_disagg.bench.engine_bench import write_gpt2_small_checkpoint
    from triton_disagg.builders.build import build_engine
    from triton_disagg.builders.demo import write_demo_checkpoint

    models = {}
    for name in names:
        checkpoint = work_dir / "checkpoints" / name
        if name == "demo":
            write_demo_checkpoint(checkpoint)
        elif name == "gpt2-small":
            say("writing a random GPT-2-small-shaped checkpoint ...")
            write_gpt2_small_checkpoint(checkpoint)
        else:
            raise UserError(f"--models: unknown model {name!r}; choose from demo, gpt2-small")
        engine_dir = work_dir / "engines" / name
        build_engine(checkpoint, engine_dir, progress=say)
        models[name] = (checkpoint, engine_dir)
    return models


def _run_engine(args: argparse.Namespace) -> int:
    from triton_disagg.bench.engine_bench import default_threads, run_engine_bench
    from triton_disagg.bench.extras import require
    from triton_disagg.bench.report import progress, publish
    from triton_disagg.engine.runtime import RUNTIMES

    require("transformers", "bench engine measures transformers beside the engine")
    batches = number_list(args.batch_sizes, "--batch-sizes", int)
    if args.prompt_len <= 0 or args.new_tokens < 2 or args.repeats < 1:
        raise UserError("--prompt-len must be > 0, --new-tokens >= 2 and --repeats >= 1")
    if args.device != "cpu":
        raise UserError("bench engine --device: cuda is measured by scripts/gpu_check.sh "
                        "(decode/prefill beside transformers on the GPU); use --device cpu")
    runtimes = [r.strip() for r in args.runtime.split(",") if r.strip()]
    unknown = sorted(set(runtimes) - set(RUNTIMES))
    if unknown or not runtimes:
        raise UserError(f"--runtime: {','.join(unknown) or 'empty'}; choose from "
                        f"{', '.join(RUNTIMES)}")
    threads = args.threads or default_threads()

    say = progress("engine")

    models = _prepare_models([m.strip() for m in args.models.split(",") if m.strip()],
                             args.work_dir, say)
    report = run_engine_bench(models, runtimes, batches, args.prompt_len, args.new_tokens,
                              threads, args.repeats, say)
    publish(report, args.output, "engine",
            "Engine throughput (numpy and torch runtimes vs transformers)", say)
    return 0

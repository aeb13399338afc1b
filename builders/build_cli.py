"""`triton-disagg build` and `triton-disagg demo-checkpoint`.

Progress lines go to stderr (``--quiet`` silences them); a user mistake is raised as a
UserError, which the CLI prints as one line with exit code 2. Heavy imports stay inside
the handlers so that `triton-disagg --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys

from triton_disagg.engine.spec import STORAGE_DTYPES
from triton_disagg.errors import UserError


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run_build(args: argparse.Namespace) -> int:
    from triton_disagg.builders.build import build_engine

    build_engine(args.checkpoint, args.output, dtype=args.dtype,
                 tokens_per_block=args.tokens_per_block, max_batch_size=args.max_batch_size,
                 max_seq_len=args.max_seq_len, kv_dtype=args.kv_dtype, force=args.force,
                 progress=None if args.quiet else _to_stderr)
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from triton_disagg.builders.demo import write_demo_checkpoint

    if args.seed < 0:
        raise UserError(f"--seed: must be a non-negative integer, got {args.seed}")
    if write_demo_checkpoint(args.output, seed=args.seed):
        _to_stderr(f"demo checkpoint written to {args.output} (seed {args.seed})")
    else:
        _to_stderr(f"demo checkpoint at {args.output} is already there (seed {args.seed}); "
                   f"nothing to do")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    build = subparsers.add_parser(
        "build", help="convert a Hugging Face checkpoint into an engine directory",
        description="Convert a Hugging Face checkpoint directory (config.json, safetensors, "
                    "tokenizer.json) into an engine directory. A rebuild with the same "
                    "checkpoint bytes and options is a no-op.")
    build.add_argument("--checkpoint", required=True, metavar="DIR",
                       help="Hugging Face checkpoint directory")
    build.add_argument("--output", required=True, metavar="DIR", help="engine directory")
    build.add_argument("--dtype", choices=STORAGE_DTYPES, default="float32",
                       help="weight storage dtype (default: float32)")
    build.add_argument("--tokens-per-block", type=int, default=16, metavar="N",
                       help="tokens per KV cache block (default: 16)")
    build.add_argument("--max-batch-size", type=int, default=32, metavar="N",
                       help="sequences per batch (default: 32)")
    build.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                       help="prompt + generated tokens per sequence "
                            "(default: min(max_position_embeddings, 2048))")
    build.add_argument("--kv-dtype", choices=STORAGE_DTYPES, default="float32",
                       help="KV cache dtype (default: float32)")
    build.add_argument("--force", action="store_true", help="rebuild even if up to date")
    build.add_argument("--quiet", action="store_true", help="print no progress")
    build.set_defaults(func=_run_build)

    demo = subparsers.add_parser(
        "demo-checkpoint", help="write the small random demo checkpoint (Llama layout)",
        description="Write a small Llama-architecture checkpoint with seeded random weights "
                    "and a byte-level BPE tokenizer, in Hugging Face layout.")
    demo.add_argument("--output", required=True, metavar="DIR", help="checkpoint directory")
    demo.add_argument("--seed", type=int, default=0, metavar="N", help="weight seed (default 0)")
    demo.set_defaults(func=_run_demo)

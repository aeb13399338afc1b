"""The `triton-disagg` console script.

Each subcommand lives in its own module, which exposes ``register(subparsers)``:
it adds its parser and sets ``func`` (called with the parsed namespace, returns an
exit code). Modules keep heavy imports (numpy, torch, tritonclient) inside their
functions so that `triton-disagg --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from triton_disagg.errors import UserError
from triton_disagg.log_format import error_line

SUBCOMMAND_MODULES = (
    "triton_disagg.builders.build_cli",      # build, demo-checkpoint
    "triton_disagg.launch.run_cli",          # run
    "triton_disagg.bench.cli",               # bench engine|serve
    "triton_disagg.launch.serve_cli",        # serve all|context|generation|scheduler
    "triton_disagg.launch.doctor_cli",       # doctor
    "triton_disagg.launch.k8s_cli",          # launch k8s
    "triton_disagg.clients.cli",             # client
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="triton-disagg",
        description="Disaggregated LLM serving on NVIDIA Triton Inference Server.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(error_line(f"triton-disagg {args.command}: error: {exc}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

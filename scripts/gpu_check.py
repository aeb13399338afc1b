"""The GPU check of the torch runtime: parity, attention backends, speed against transformers
and the weight-read limit, a NIXL READ of device memory between two processes, device memory
and the KV handoff. Writes markdown tables.

Needs PyTorch (with CUDA for ``--device cuda``) and this package; transformers and NIXL
are used when importable (their tables say so when not). ``--device cpu --tiny`` is the
smoke run the tests use so that this script does not rot.

Sections, one module each (its docstring says what it checks and how):

1. parity (``gpu_check_parity.py``): greedy tokens of five architectures, float32 against
   the numpy runner on CPU, ``--dtype`` against float32 over the decode steps, with
   torch's default SDPA backends and with serving's (cuDNN off);
2. attention (``gpu_check_attention.py``): which SDPA backend each kind of pass ran;
3. speed (``gpu_check_speed.py``): decode and prefill tok/s beside transformers and the
   weight-read limit;
4. nixl (``gpu_check_nixl.py``): a READ of device memory from another process beside a
   local copy;
5. memory (``gpu_check_memory.py``): placement, a dropped engine freed, the KV pool's
   size, the out-of-memory line;
6. handoff (``gpu_check_handoff.py``): KV staged device -> host -> device decodes the same
   greedy tokens; disaggregated context + generation engines on one device, the KV moved
   by each strategy's real connector, give the aggregated greedy text.

Invariant: the output file holds the header (device, torch / CUDA / cuDNN versions) from
the start and each section's table from the moment that section ends, so a crash, a kill
or the time limit loses at most the section running. A section that raises is written
as its error and traceback in its table's place, and the others still run; the exit status
is then 1. Between sections dropped engines are collected and the CUDA cache emptied.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from triton_disagg.engine.torch_device import TORCH_DTYPES

from gpu_check_attention import environment_lines
from gpu_check_memory import release_device_memory

Say = Callable[[str], None]
Section = Callable[[argparse.Namespace, Say], list[str]]


def _runtime_dtype(args: argparse.Namespace) -> str:
    """The dtype engines run in: ``--dtype`` on CUDA, float32 on CPU (the Runtime's rule)."""
    return "float32" if args.device == "cpu" else args.dtype


# Each section imports its module when it runs, so a dependency missing on the device
# image (the handoff section's msgpack, say) fails that section alone, in its table's place.

def _parity(a: argparse.Namespace, say: Say) -> list[str]:
    from gpu_check_parity import parity_table
    return parity_table(a.device, a.dtype, say)


def _attention(a: argparse.Namespace, say: Say) -> list[str]:
    from gpu_check_attention import attention_table
    return attention_table(a.device, _runtime_dtype(a), say)


def _speed(a: argparse.Namespace, say: Say) -> list[str]:
    from gpu_check_speed import speed_table
    return speed_table(a.device, _runtime_dtype(a), a.tiny, say)


def _nixl(a: argparse.Namespace, say: Say) -> list[str]:
    from gpu_check_nixl import nixl_table
    return nixl_table(a.device, (16 << 20) if a.tiny else (1 << 30), 1 if a.tiny else 3, say)


def _memory(a: argparse.Namespace, say: Say) -> list[str]:
    from gpu_check_memory import memory_table
    return memory_table(a.device, _runtime_dtype(a), say)


def _handoff(a: argparse.Namespace, say: Say) -> list[str]:
    from gpu_check_handoff import handoff_table
    return handoff_table(a.device, _runtime_dtype(a), say)


SECTIONS: dict[str, tuple[str, Section]] = {   # name -> (title, table)
    "parity": ("Parity (greedy tokens: float32 vs the numpy runner, low precision vs float32)",
               _parity),
    "attention": ("Attention: the SDPA backend each pass ran", _attention),
    "speed": ("Speed (random weights made on the device)", _speed),
    "nixl": ("NIXL READ between two processes vs a local copy", _nixl),
    "memory": ("Device memory: placement, freeing, KV pool size, out of memory at load",
               _memory),
    "handoff": ("KV handoff: staged device -> host -> device, and disaggregated through each "
                "KV strategy's connector", _handoff),
}


def run_section(name: str, args: argparse.Namespace, say: Say) -> tuple[list[str], bool]:
    """Section ``name``'s markdown (title, table, time taken) and whether it ran to the end;
    an exception becomes its error and traceback in the table's place."""
    title, table = SECTIONS[name]
    started = time.perf_counter()
    try:
        body, ok = table(args, say), True
    except Exception as exc:        # noqa: BLE001 - any failure is reported, the rest run
        body, ok = [f"**FAILED**: `{type(exc).__name__}: {exc}`", "", "```",
                    traceback.format_exc().rstrip(), "```"], False
        say(f"section {name} failed: {type(exc).__name__}: {exc}")
    finally:
        release_device_memory()
    return [f"## {title}", "", *body, "",
            f"({name}: {time.perf_counter() - started:.0f} s)", ""], ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dtype", choices=list(TORCH_DTYPES), default="bfloat16",
                        help="low-precision dtype checked beside float32 (engines on CUDA; "
                             "the parity section's runners on CPU too)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes and few steps: the smoke run")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--output", type=Path, required=True, help="markdown file to write")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: --device cuda, but torch {torch.__version__} sees no CUDA GPU",
              file=sys.stderr)
        return 2
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"--sections: {', '.join(unknown)} not among {', '.join(SECTIONS)}")

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def append(lines: list[str]) -> None:
        with args.output.open("a") as out:
            out.write("\n".join(lines) + "\n")

    args.output.write_text("")
    append(["# GPU check: torch runtime", "", *environment_lines(args.device), ""])
    started, failed = time.perf_counter(), []
    for name in sections:
        say(f"section {name} ...")
        lines, ok = run_section(name, args, say)
        append(lines)
        if not ok:
            failed.append(name)
    append([f"Took {time.perf_counter() - started:.0f} s; "
            f"{'sections that failed: ' + ', '.join(failed) if failed else 'every section ran'}."])
    print(args.output.read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU check of the torch runtime: parity, speed against transformers and the weight-read
limit, and a NIXL READ of device memory between two processes. Writes markdown tables.

Needs PyTorch (with CUDA for ``--device cuda``) and this package; transformers and NIXL
are used when importable (their tables say so when not). ``--device cpu --tiny`` is the
smoke run the unit tests use so that this script does not rot.

Sections, one module each (its docstring says what it checks and how):

1. parity (``gpu_check_parity.py``): greedy tokens of five architectures against the
   numpy runner on CPU;
2. speed (``gpu_check_speed.py``): decode and prefill tok/s beside transformers and the
   weight-read limit;
3. nixl (``gpu_check_nixl.py``): a READ of device memory from another process beside a
   local copy;
4. memory (``gpu_check_memory.py``): placement, the KV pool's size, the out-of-memory line;
5. handoff (``gpu_check_handoff.py``): KV staged device -> host -> device decodes the same
   greedy tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from triton_disagg.engine.torch_model import TORCH_DTYPES

from gpu_check_handoff import handoff_table
from gpu_check_memory import memory_table
from gpu_check_nixl import nixl_table
from gpu_check_parity import LOW_PRECISION_LOGIT_TOLERANCE, parity_table
from gpu_check_speed import speed_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dtype", choices=list(TORCH_DTYPES), default="bfloat16",
                        help="low-precision dtype checked beside float32 (CUDA only)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes and few steps: the smoke run")
    parser.add_argument("--sections", default="parity,speed,nixl,memory,handoff",
                        help="comma-separated subset of parity,speed,nixl,memory,handoff")
    parser.add_argument("--output", type=Path, required=True, help="markdown file to write")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: --device cuda, but torch {torch.__version__} sees no CUDA GPU",
              file=sys.stderr)
        return 2
    dtype = "float32" if args.device == "cpu" else args.dtype
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    out = [f"# GPU check: torch runtime on {name} (torch {torch.__version__})", ""]
    started = time.perf_counter()
    if "parity" in sections:
        tolerance = "float32 must match exactly" + (
            "" if dtype == "float32" else f"; {dtype}: first-step logits within "
                                          f"{LOW_PRECISION_LOGIT_TOLERANCE} of float32 CPU")
        out += ["## Parity (greedy tokens vs the numpy runner on CPU)", "", tolerance, ""]
        out += parity_table(args.device, dtype, say) + [""]
    if "speed" in sections:
        out += ["## Speed (random weights made on the device)", ""]
        out += speed_table(args.device, dtype, args.tiny, say) + [""]
    if "nixl" in sections:
        out += ["## NIXL READ between two processes vs a local copy", ""]
        out += nixl_table(args.device, (16 << 20) if args.tiny else (1 << 30),
                          1 if args.tiny else 3, say) + [""]
    if "memory" in sections:
        out += ["## Device memory: placement, KV pool size, out of memory at load", ""]
        out += memory_table(args.device, dtype, say) + [""]
    if "handoff" in sections:
        out += ["## KV handoff staged through host memory (device -> host -> device)", ""]
        out += handoff_table(args.device, dtype, say) + [""]
    out.append(f"Took {time.perf_counter() - started:.0f} s.")
    args.output.write_text("\n".join(out) + "\n")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""scripts/gpu_check.py, section "attention": which SDPA backend (flash, efficient, cuDNN,
math) each kind of attention pass of the torch runner ran, with the backends serving allows
(:data:`~triton_disagg.engine.torch_device.SERVING_SDPA_BACKENDS`: no cuDNN) and with torch's
own choice; and the versions the header names (CUDA, cuDNN). The backend is read from the
profiler: the aten op each SDPA call dispatched to.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import Runtime
from triton_disagg.engine.torch_device import SERVING_SDPA_BACKENDS

from gpu_check_models import write_tiny_engine

SDPA_OPS = {     # the aten op an SDPA call dispatches to -> its backend
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cuDNN",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
BACKEND_CHOICES = {"serving (flash, efficient, math)": list(SERVING_SDPA_BACKENDS),
                   "torch default (cuDNN allowed)": None}


def sdpa_backends_ran(run: Callable[[], Any]) -> str:
    """The SDPA backends ``run()`` dispatched to, comma-separated ("none": no SDPA call)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return ", ".join(sorted({SDPA_OPS[e.name] for e in prof.events() if e.name in SDPA_OPS})) \
        or "none"


def environment_lines(device: str) -> list[str]:
    """torch, CUDA and cuDNN versions, the device, and the SDPA backends torch enables."""
    cuda = torch.backends.cuda
    enabled = [name for name, on in (("flash", cuda.flash_sdp_enabled()),
                                     ("efficient", cuda.mem_efficient_sdp_enabled()),
                                     ("cuDNN", cuda.cudnn_sdp_enabled()),
                                     ("math", cuda.math_sdp_enabled())) if on]
    name = "CPU"
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        name = f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    return [f"- device: {name}",
            f"- torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, "
            f"cuDNN {torch.backends.cudnn.version() or 'none'}",
            f"- SDPA backends torch enables: {', '.join(enabled)}; serving allows "
            f"{', '.join(b.name for b in SERVING_SDPA_BACKENDS)}"]


def attention_table(device: str, dtype: str, say) -> list[str]:
    lines = ["| pass | SDPA backends allowed | backend that ran |", "|---|---|---|"]
    prompts = [(list(range(3, 40)), [0, 1, 2]), (list(range(5, 30)), [3, 4])]
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = write_tiny_engine(Path(tmp) / "llama", "llama")
        runner = LLMEngine(engine_dir, num_blocks=16,
                           runtime=Runtime("torch", device, dtype)).runner
        passes = {
            "prefill of fresh prompts (is_causal, no mask)": lambda: runner.prefill(prompts),
            "decode, one length (no mask)": lambda: runner.decode([1, 1], [20, 20],
                                                                  [[0, 1, 2], [3, 4]]),
            "decode, lengths differ (key-length mask)": lambda: runner.decode(
                [1, 1], [37, 25], [[0, 1, 2], [3, 4]]),
        }
        for allowed, backends in BACKEND_CHOICES.items():
            runner.sdpa_backends = backends
            for what, run in passes.items():
                lines.append(f"| {what} | {allowed} | {sdpa_backends_ran(run)} |")
                say(lines[-1])
    return lines

"""Where and how the torch runner computes: its dtypes, the SDPA kernels serving allows, the
CUDA device current in whichever thread calls it, and one CPU thread for small attention.

Invariant: every entry point of a runner on ``cuda:N`` runs with ``cuda:N`` current in the
calling thread (:func:`on_runner_device`), so no implicit-device call lands on GPU 0.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch
from torch.nn.attention import SDPBackend

# Attention whose gathered KV is at most this many bytes runs on one CPU thread: split
# over threads, such small ops cost more in thread wake-ups than they save (measured on
# 2 busy cores: gather + SDPA of one decode token 0.5 ms on one thread, 3.5 ms on two).
SINGLE_THREAD_ATTENTION_BYTES = 4 << 20

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The SDPA backends serving may use: cuDNN is left out. torch >= 2.11 prefers cuDNN
# attention on sm_90, which builds (and caches) an execution graph per new (batch, length)
# shape, a stall of tens to hundreds of ms whenever a decode batch or prompt length is new,
# and raises on a plan it cannot build instead of falling back. Flash / memory-efficient
# kernels need no per-shape build; math is the fallback of last resort (and CPU's choice
# where flash does not apply). Pinning was chosen over bucketing shapes: bucketing pads
# every batch and prompt (wasted FLOPs, a mask again) and still builds one graph per bucket.
# ``sdpa_kernel`` sets process-wide flags for the pass: one runner per process computes
# (a serving instance's engine loop; other threads only copy blocks), so none interleave.
SERVING_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                         SDPBackend.MATH)


def device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` the current CUDA device of the calling thread for a block (CPU: no-op).

    torch's current device is per thread and starts at GPU 0 in every new thread, so each
    entry point of a runner on ``cuda:N`` runs in this scope, whichever thread calls it (the
    engine loop, the KV fetch thread, a Triton request thread): implicit-device calls (a
    bare ``torch.empty(..., device="cuda")``, ``torch.cuda.synchronize()``, streams, a
    registration of device memory) then land on the instance's GPU, not on GPU 0."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def on_runner_device(method):
    """Run a runner method in :func:`device_scope` of its device and in inference mode."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with device_scope(self.device), torch.inference_mode():
            return method(self, *args, **kwargs)
    return wrapped


class OneCpuThread:
    """A reusable context: its block runs on one intra-op thread, then the count returns."""

    def __enter__(self) -> None:
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.threads)


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a KV pool's numpy dtype (float32 or float16)."""
    return torch.from_numpy(np.empty(0, dtype)).dtype

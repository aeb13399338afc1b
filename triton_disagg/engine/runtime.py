"""Which model runner an engine uses: ``model: {runtime, device, dtype}`` of the config.

``numpy`` is the float32 reference (:mod:`triton_disagg.engine.model`); ``torch`` is
:mod:`triton_disagg.engine.torch_model`, on CPU (float32) or one CUDA device. Both take
the same engine directory and expose the same entry points, so everything around the
runner (scheduler, block pool, sampling, KV connectors) is shared.

Invariant: a :class:`Runtime` is valid when it is constructed (known names; float32 on
CPU; numpy on CPU only), and :func:`make_runner` fails with one line when the device is
not there (``device: cuda`` with no GPU visible).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from triton_disagg.engine.block_pool import BlockPool
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.errors import UserError

RUNTIMES = ("numpy", "torch")
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# On CPU numpy is the default: it measured faster than the torch runner at batch 1-8 on
# this project's benchmark machine (docs/benchmarks.md); torch is the default on CUDA.
DEFAULT_CPU_RUNTIME = "numpy"
CUDA_KV_FRACTION = 0.9   # of the device memory free after the weights, for the KV pool


@dataclass(frozen=True)
class Runtime:
    """The runner an engine instance uses."""

    runtime: str = DEFAULT_CPU_RUNTIME
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for key, value, allowed in (("runtime", self.runtime, RUNTIMES),
                                    ("device", self.device, DEVICES),
                                    ("dtype", self.dtype, DTYPES)):
            if value not in allowed:
                raise UserError(f"model.{key}: {value!r} is not one of {', '.join(allowed)}")
        if self.device == "cuda" and self.runtime != "torch":
            raise UserError("model.device: cuda needs model.runtime: torch (numpy runs on CPU)")
        if self.device == "cpu" and self.dtype != "float32":
            raise UserError(f"model.dtype: {self.dtype} runs on CUDA only; use float32 on CPU")

    @classmethod
    def default(cls, runtime: str | None = None, device: str | None = None,
                dtype: str | None = None) -> "Runtime":
        """Fill what is not given: torch on CUDA when a GPU is visible, else the CPU default;
        bfloat16 on CUDA, float32 on CPU."""
        if device is None:
            device = "cuda" if runtime != "numpy" and _cuda_visible() else "cpu"
        if runtime is None:
            runtime = "torch" if device == "cuda" else DEFAULT_CPU_RUNTIME
        if dtype is None:
            dtype = "bfloat16" if device == "cuda" else "float32"
        return cls(runtime, device, dtype)


def check_choice(runtime: str | None, device: str | None, dtype: str | None) -> None:
    """Raise the one-line :class:`UserError` of a bad ``model.runtime/device/dtype``
    (``None``: chosen on the serving host); touches no GPU."""
    for key, value, allowed in (("runtime", runtime, RUNTIMES), ("device", device, DEVICES),
                                ("dtype", dtype, DTYPES)):
        if value is not None and value not in allowed:
            raise UserError(f"model.{key}: {value!r} is not one of {', '.join(allowed)}")
    if device is not None or runtime == "numpy":
        Runtime.default(runtime, device, dtype)


def device_kv_budget(max_bytes: int | None, weight_bytes: int,
                     fraction: float = CUDA_KV_FRACTION) -> int:
    """KV bytes of one instance's pool on the current CUDA device: ``fraction`` of its free
    memory less the ``weight_bytes`` still to be loaded, capped by ``kv_cache.max_size``."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    budget = max(0, int((free - weight_bytes) * fraction))
    return budget if max_bytes is None else min(budget, int(max_bytes))


def _cuda_visible() -> bool:
    """Is a CUDA GPU visible to torch (False without torch, or without an NVIDIA device
    node: then torch is not even imported)?"""
    if not os.path.exists("/dev/nvidiactl"):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def make_runner(runtime: Runtime, spec: EngineSpec, weights: dict[str, np.ndarray],
                pool: BlockPool):
    """The model runner of ``runtime`` over ``pool``; torch on CPU uses as many threads as
    this process may run on cores (its affinity mask, set by the instance's pinning)."""
    if runtime.runtime == "numpy":
        from triton_disagg.engine.model import ModelRunner

        return ModelRunner(spec, weights, pool)
    try:
        import torch
    except ImportError:
        raise UserError("model.runtime: torch needs PyTorch; pip install "
                        "'triton-disagg[torch]'") from None
    from triton_disagg.engine.torch_model import TorchModelRunner

    if runtime.device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"model.device: cuda, but torch {torch.__version__} sees no CUDA GPU; "
                        f"use model.device: cpu or run on a GPU host")
    if runtime.device == "cpu":
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    return TorchModelRunner(spec, weights, pool, runtime.device, runtime.dtype)

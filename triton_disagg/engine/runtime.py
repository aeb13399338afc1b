"""Which model runner an engine uses: ``model: {runtime, device, dtype}`` of the config.

``numpy`` is the float32 reference (:mod:`triton_disagg.engine.model`); ``torch`` is
:mod:`triton_disagg.engine.torch_model`, on CPU (float32) or one CUDA device. Both take
the same engine directory and expose the same entry points, so everything around the
runner (scheduler, block pool, sampling, KV connectors) is shared.

Invariant: a :class:`Runtime` is valid when it is constructed (known names; float32 on
CPU; numpy on CPU only; a device index on CUDA only), and :func:`make_runner` fails with
one line when the device is not there (``device: cuda`` with no GPU visible) or cannot
hold the engine (out of device memory at load: the line names the settings to lower).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, get_args
# Any here: the config's raw YAML values, checked by check_choice.

import numpy as np

from triton_disagg.engine.block_pool import BlockPool
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.errors import UserError
from triton_disagg.kv.layout import BlockGeometry

Runner = Literal["numpy", "torch"]
Device = Literal["cpu", "cuda"]
DType = Literal["float32", "bfloat16", "float16"]
RUNTIMES: tuple[Runner, ...] = get_args(Runner)
DEVICES: tuple[Device, ...] = get_args(Device)
DTYPES: tuple[DType, ...] = get_args(DType)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# On CPU numpy is the default: it measured faster than the torch runner at batch 1-8 on
# this project's benchmark machine (docs/benchmarks.md); torch is the default on CUDA.
DEFAULT_CPU_RUNTIME: Runner = "numpy"
# kv_cache.gpu_memory_fraction's default: the share of the device memory free after the
# weights that the KV pool takes (the rest: activations, CUDA graphs, the allocator's slack).
CUDA_KV_FRACTION = 0.9


@dataclass(frozen=True)
class Runtime:
    """The runner an engine instance uses."""

    runtime: Runner = DEFAULT_CPU_RUNTIME
    device: Device = "cpu"
    dtype: DType = "float32"
    device_index: int = 0     # which CUDA device (the Triton instance's device id)

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
        if self.device_index < 0 or (self.device == "cpu" and self.device_index):
            raise UserError(f"device index {self.device_index}: only CUDA devices are "
                            f"numbered (0, 1, ...)")

    @property
    def on_cuda(self) -> bool:
        """The runner, its weights and its KV pool live on a CUDA device."""
        return self.device == "cuda"

    @property
    def torch_device(self) -> str:
        """``cpu`` or ``cuda:N``: where the runner's weights and KV pool live."""
        return f"cuda:{self.device_index}" if self.device == "cuda" else "cpu"

    def kv_block_bytes(self, geometry: BlockGeometry) -> int:
        """Bytes of one KV block where this runtime's runner keeps it: on CUDA one device
        tensor in the runtime's dtype (bfloat16 KV of a float32 layout: half the bytes),
        on CPU the pool's own array (the layout's dtype)."""
        if self.device == "cpu":
            return geometry.block_nbytes
        return int(np.prod(geometry.block_shape)) * DTYPE_BYTES[self.dtype]

    @classmethod
    def default(cls, runtime: Runner | None = None, device: Device | None = None,
                dtype: DType | None = None, device_index: int | None = None) -> "Runtime":
        """Fill what is not given: torch on CUDA when a GPU is visible, else the CPU default;
        bfloat16 on CUDA, float32 on CPU. ``device_index`` (a Triton GPU instance's device
        id) applies on CUDA and is dropped on CPU."""
        if device is None:
            device = "cuda" if runtime != "numpy" and _cuda_visible() else "cpu"
        if runtime is None:
            runtime = "torch" if device == "cuda" else DEFAULT_CPU_RUNTIME
        if dtype is None:
            dtype = "bfloat16" if device == "cuda" else "float32"
        index = device_index if device == "cuda" and device_index is not None else 0
        return cls(runtime, device, dtype, index)


def check_choice(runtime: Any, device: Any, dtype: Any) -> None:
    """Raise the one-line :class:`UserError` of a bad ``model.runtime/device/dtype``
    (``None``: chosen on the serving host); touches no GPU."""
    for key, value, allowed in (("runtime", runtime, RUNTIMES), ("device", device, DEVICES),
                                ("dtype", dtype, DTYPES)):
        if value is not None and value not in allowed:
            raise UserError(f"model.{key}: {value!r} is not one of {', '.join(allowed)}")
    if device is not None or runtime == "numpy":
        Runtime.default(runtime, device, dtype)


def device_kv_budget(max_bytes: int | None, weight_bytes: int,
                     fraction: float = CUDA_KV_FRACTION, device: str = "cuda") -> int:
    """KV bytes of one instance's pool on CUDA ``device``: :func:`kv_budget` of its free
    memory now."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return kv_budget(free, max_bytes, weight_bytes, fraction)


def kv_budget(free_bytes: int, max_bytes: int | None, weight_bytes: int,
              fraction: float) -> int:
    """``fraction`` (``kv_cache.gpu_memory_fraction``) of the ``free_bytes`` a device has
    less the ``weight_bytes`` still to be loaded, capped by ``max_bytes``
    (``kv_cache.max_size``); never negative."""
    budget = max(0, int((free_bytes - weight_bytes) * fraction))
    return budget if max_bytes is None else min(budget, int(max_bytes))


def device_pool_blocks(runtime: Runtime, geometry: BlockGeometry, budget: int,
                       fraction: float, blocks_needed: int) -> int:
    """KV blocks of a CUDA pool of ``budget`` bytes (:func:`device_kv_budget`), or the one
    line naming the settings when they are fewer than ``blocks_needed`` (one longest
    sequence)."""
    blocks = budget // runtime.kv_block_bytes(geometry)
    if blocks < blocks_needed:
        need_mib = -(-blocks_needed * runtime.kv_block_bytes(geometry) // 2**20)
        raise UserError(
            f"out of memory on {runtime.torch_device}: kv_cache.gpu_memory_fraction {fraction} "
            f"of the memory free after the weights, capped by kv_cache.max_size, is "
            f"{budget >> 20} MiB, {blocks} KV blocks, but one max_seq_len sequence needs "
            f"{blocks_needed} ({need_mib} MiB); raise kv_cache.gpu_memory_fraction or "
            f"kv_cache.max_size, or free the device")
    return blocks


def pool_blocks(runtime: Runtime, spec: EngineSpec, geometry: BlockGeometry,
                weights: dict[str, np.ndarray], num_blocks: int | None,
                kv_max_bytes: int | None, fraction: float) -> int:
    """An engine's pool size in blocks: ``num_blocks`` when given; on CUDA, ``fraction`` of
    the device memory free after the weights, capped by ``kv_max_bytes``
    (:func:`device_kv_budget`, :func:`device_pool_blocks`); else ``kv_max_bytes`` worth of
    blocks; else ``max_batch_size`` sequences of ``max_seq_len`` tokens."""
    if num_blocks is not None:
        return num_blocks
    if runtime.on_cuda:
        weight_bytes = sum(w.size for w in weights.values()) * DTYPE_BYTES[runtime.dtype]
        budget = device_kv_budget(kv_max_bytes, weight_bytes, fraction, runtime.torch_device)
        return device_pool_blocks(runtime, geometry, budget, fraction,
                                  geometry.blocks_for(spec.max_context - 1))
    if kv_max_bytes is not None:
        return BlockPool.blocks_for_budget(geometry, kv_max_bytes)
    return spec.max_batch_size * geometry.blocks_for(spec.max_seq_len)


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
    this process may run on cores (its affinity mask, set by the instance's pinning). On
    CUDA the instance's device becomes this thread's current one (the runner also enters
    it on every call, from whichever thread: :func:`~triton_disagg.engine.torch_device.device_scope`)."""
    if runtime.runtime == "numpy":
        from triton_disagg.engine.model import ModelRunner

        return ModelRunner(spec, weights, pool)
    try:
        import torch
    except ImportError:
        raise UserError("model.runtime: torch needs PyTorch; pip install "
                        "'triton-disagg[cpu]' (or [gpu] on a CUDA host)") from None
    from triton_disagg.engine.torch_model import TorchModelRunner

    if runtime.device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"model.device: cuda, but torch {torch.__version__} sees no CUDA GPU; "
                        f"use model.device: cpu or run on a GPU host")
    if runtime.device == "cpu":
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    else:
        torch.cuda.set_device(runtime.device_index)
    try:
        return TorchModelRunner(spec, weights, pool, runtime.torch_device, runtime.dtype)
    except torch.OutOfMemoryError:
        raise UserError(out_of_memory_message(runtime, weights, pool)) from None


def out_of_memory_message(runtime: Runtime, weights: dict[str, np.ndarray],
                          pool: BlockPool) -> str:
    """The one line for an engine that does not fit its device at load, naming what to lower."""
    weight_mib = sum(w.size for w in weights.values()) * DTYPE_BYTES[runtime.dtype] >> 20
    kv_mib = pool.num_total * runtime.kv_block_bytes(pool.geometry) >> 20
    return (f"out of memory on {runtime.torch_device} loading the engine ({weight_mib} MiB of "
            f"{runtime.dtype} weights + a {kv_mib} MiB KV pool); lower "
            f"kv_cache.gpu_memory_fraction or kv_cache.max_size, or use a smaller engine")

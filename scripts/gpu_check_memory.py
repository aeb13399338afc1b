"""scripts/gpu_check.py, section "memory": an engine on the last visible device (as a Triton
GPU instance with that device id gets) holds its weights and KV pool there, the pool sized
by ``kv_cache.gpu_memory_fraction`` of the memory free after the weights; and an engine that
does not fit is the one out-of-memory line naming the settings to lower; a dropped engine is
freed by ``del`` alone (no reference cycle keeps its device memory until a collection).
On CPU only the placement and freed rows run (the pool is host memory).
"""

from __future__ import annotations

import gc
import tempfile
import weakref
from pathlib import Path

import torch

from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import DTYPE_BYTES, Runtime, kv_budget
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.engine.weights import load_engine
from triton_disagg.errors import UserError

from gpu_check_models import write_tiny_engine


MEMORY_CHECK_FRACTION = 0.05   # small: the check needs no large pool


def memory_table(device: str, dtype: str, say) -> list[str]:
    lines = ["| check | expected | got | verdict |", "|---|---|---|---|"]

    def row(check: str, expected: str, got: str, ok: bool) -> None:
        lines.append(f"| {check} | {expected} | {got} | {'ok' if ok else 'FAIL'} |")
        say(lines[-1])

    index = torch.cuda.device_count() - 1 if device == "cuda" else None
    runtime = Runtime.default("torch", device, dtype, index)
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = write_tiny_engine(Path(tmp) / "llama", "llama")
        if device == "cuda":
            free_before, _ = torch.cuda.mem_get_info(runtime.torch_device)
        engine = LLMEngine(engine_dir, runtime=runtime, kv_max_bytes=None if device == "cuda"
                           else 1 << 20, kv_memory_fraction=MEMORY_CHECK_FRACTION)
        where = {str(engine.runner.kv.device), str(engine.runner.embed.device)}
        row("weights and KV pool placed", runtime.torch_device, ", ".join(sorted(where)),
            where == {str(torch.device(runtime.torch_device))})
        pool_bytes = engine.pool.num_total * runtime.kv_block_bytes(engine.pool.geometry)
        pool = weakref.ref(engine.runner.kv)
        del engine
        freed_by_del = pool() is None          # before any collection: no reference cycle
        release_device_memory()
        row("engine freed by del, before garbage collection", "KV pool unreferenced",
            "unreferenced" if freed_by_del else
            f"{'freed by gc' if pool() is None else 'still referenced'}", freed_by_del)
        if device != "cuda":
            return lines
        weight_bytes = sum(w.size for w in load_engine(engine_dir)[1].values()) * (
            DTYPE_BYTES[dtype])
        expected = kv_budget(free_before, None, weight_bytes, MEMORY_CHECK_FRACTION)
        row(f"KV pool at gpu_memory_fraction {MEMORY_CHECK_FRACTION}",
            f"{expected / 2**30:.2f} GiB", f"{pool_bytes / 2**30:.2f} GiB",
            abs(pool_bytes - expected) <= 0.02 * expected)
        free, _ = torch.cuda.mem_get_info(runtime.torch_device)
        filler = torch.empty(free - (64 << 20), dtype=torch.uint8, device=runtime.torch_device)
        try:
            LLMEngine(engine_dir, runtime=runtime,
                      num_blocks=(1 << 30) // engine_pool_block_bytes(engine_dir))
            got, ok = "loaded", False
        except UserError as exc:
            got = str(exc)
            ok = "\n" not in got and "kv_cache.gpu_memory_fraction" in got
        finally:
            del filler
            release_device_memory()
        row("1 GiB pool with 64 MiB free", "one line naming kv_cache.gpu_memory_fraction",
            got.replace("|", "/"), ok)
    return lines


def release_device_memory() -> None:
    """Collect garbage and return the CUDA allocator's cached blocks to the device, so the
    next section (or row) measures free memory without what a dropped engine held."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_pool_block_bytes(engine_dir: Path) -> int:
    return EngineSpec.load(engine_dir).block_geometry().block_nbytes

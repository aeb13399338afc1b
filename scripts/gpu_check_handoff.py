"""scripts/gpu_check.py, section "handoff": a sequence prefilled on the device, staged device
-> host rows -> device into a second engine through bounded staging buffers (what both KV
strategies do on CUDA), decodes the same greedy tokens as the first engine going on alone.
On CPU each runner's KV is cloned apart from its host array, so the copies still run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import Runtime
from triton_disagg.kv.device_staging import DeviceStaging

from gpu_check_models import write_tiny_engine


def handoff_table(device: str, dtype: str, say) -> list[str]:
    """A sequence prefilled by one engine on ``device`` and handed to another through staging
    rows (``to_host``, the bytes a KV connector moves, ``to_device``) decodes the same
    greedy tokens as the first engine going on alone."""
    lines = ["| architecture | dtype | greedy tokens after the handoff equal | verdict |",
             "|---|---|---:|---|"]
    prompt, n = list(range(3, 40)), 16
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = write_tiny_engine(Path(tmp) / "llama", "llama")
        runtime = Runtime("torch", device, dtype)
        context, generation = (LLMEngine(engine_dir, num_blocks=16, runtime=runtime).runner
                               for _ in range(2))
        if device == "cpu":     # the smoke run: give each runner KV apart from its host array
            context.kv, generation.kv = context.kv.clone(), generation.kv.clone()
        need = context.pool.geometry.blocks_for(len(prompt) + n)
        src, dst = list(range(need)), list(range(need, 2 * need))
        token = int(np.argmax(context.prefill([(prompt, src)])[0]))
        geometry = context.pool.geometry
        out, into = DeviceStaging(context, geometry, need), DeviceStaging(generation, geometry, need)
        out_rows, into_rows = out.reserve(src), into.reserve(dst)
        out.to_host(src)
        into.array[into_rows] = out.array[out_rows]             # what a connector moves
        into.to_device(into_rows)
        streams = {"alone": (context, src, [token]), "handed off": (generation, dst, [token])}
        for runner, blocks, out in streams.values():
            for step in range(n - 1):
                logits = runner.decode([out[-1]], [len(prompt) + step], [blocks])
                out.append(int(np.argmax(logits[0])))
        alone, moved = streams["alone"][2], streams["handed off"][2]
        same = next((i for i, (a, b) in enumerate(zip(moved, alone)) if a != b), n)
        lines.append(f"| llama | {dtype} | {same}/{n} | {'ok' if same == n else 'FAIL'} |")
        say(lines[-1])
    return lines

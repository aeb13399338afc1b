"""scripts/gpu_check.py, section "handoff": a sequence prefilled on the device, staged device
-> host rows -> device into a second engine through bounded staging buffers (what both KV
strategies do on CUDA), decodes the same greedy tokens as the first engine going on alone.
On CPU each runner's KV is cloned apart from its host array, so the copies still run.

Then disaggregated serving at the engine level: a context engine and a generation engine
on the same device, the prompt's KV exported and fetched through each KV strategy's real
connector (``host_memory``: shared memory; ``direct_transfer``: NIXL, skipped with the
reason when it is not importable), give the same greedy text as one aggregated engine.
Triton is not involved (the device image has no tritonserver).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import Runtime
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.generation.decode_loop import FetchedKV
from triton_disagg.kv.connector import STRATEGIES
from triton_disagg.kv.connector_factory import connector_for
from triton_disagg.kv.secret import SECRET_ENV, render_key_id
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
        lines += ["", "| KV strategy | disaggregated greedy tokens equal to aggregated | verdict |",
                  "|---|---:|---|"]
        for strategy in STRATEGIES:
            lines.append(disaggregated_row(engine_dir, runtime, strategy, prompt, n))
            say(lines[-1])
    return lines


def disaggregated_row(engine_dir: Path, runtime: Runtime, strategy: str, prompt: list[int],
                      n: int) -> str:
    """One table row: ``n`` greedy tokens of ``prompt`` prefilled by a context engine, its KV
    handed to a generation engine by ``strategy``'s connector, against one engine alone."""
    if strategy == "direct_transfer":
        try:
            import nixl  # noqa: F401
        except ImportError as exc:
            return f"| {strategy} | skipped: NIXL not importable ({exc}) | skipped |"
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))
    settings = SimpleNamespace(kv_strategy=strategy, kv_key_id=render_key_id(),
                               kv_lease_seconds=30.0, kv_max_size=1 << 26)
    params = SamplingParams(max_tokens=n)
    (alone,) = LLMEngine(engine_dir, num_blocks=16, runtime=runtime).generate([prompt], params)
    context, generation = (LLMEngine(engine_dir, num_blocks=16, runtime=runtime)
                           for _ in range(2))
    sender = connector_for(settings, context, f"gpuchk{os.getpid()}_ctx", context.pool.free)
    receiver = connector_for(settings, generation, f"gpuchk{os.getpid()}_gen")
    try:
        (first,) = context.prefill_only([("r", prompt, params)])
        data = sender.export(first.block_ids, first.num_tokens)
        generation.add_prefilled("r", prompt, first.token_id, params,
                                 FetchedKV(receiver, receiver.decode(data)))
        tokens = [first.token_id]
        while generation.has_unfinished():
            tokens += [t for event in generation.step() for t in event.tokens]
    finally:
        receiver.close()
        sender.close()
    same = next((i for i, (a, b) in enumerate(zip(tokens, alone.output_ids)) if a != b), n)
    same = min(same, len(tokens))
    return f"| {strategy} | {same}/{n} | {'ok' if same == n == len(tokens) else 'FAIL'} |"

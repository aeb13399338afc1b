"""The GPU check of the torch runtime: parity, speed against transformers and the weight-read
limit, and a NIXL READ of device memory between two processes. Writes markdown tables.

Needs PyTorch (with CUDA for ``--device cuda``) and this package; transformers and NIXL
are used when importable (their tables say so when not). ``--device cpu --tiny`` is the
smoke run the unit tests use so that this script does not rot.

Sections:

1. parity: greedy tokens of the five architectures (random tiny engines written here),
   the runtime on ``--device`` in float32 and in ``--dtype`` against the numpy runner on
   CPU (float32, the reference the unit tests hold to Hugging Face). float32 must match
   exactly; bfloat16/float16 round every matmul, so a near-tie may flip a token: the
   table gives the matching prefix and the largest first-step logit difference
   (tolerance stated there, ``LOW_PRECISION_LOGIT_TOLERANCE``).
2. speed: decode tok/s at batch 1, 16, 64 and prefill tok/s of a 2000-token prompt for
   Llama-3.2-1B- and Llama-3-8B-shaped models with random weights made on the device,
   beside transformers (same shapes, same dtype, its own cache) and the weight-read limit
   ``batch / (weight bytes / copy bandwidth)``; logits go to the host every step, as the
   engine samples there.
3. nixl: a READ of a device buffer from another process (UCX, VRAM; DRAM on CPU) beside a
   device-to-device copy of the same bytes in one process.
4. memory: an engine on the last visible device (as a Triton GPU instance with that
   device id gets) holds its weights and KV pool there, the pool sized by
   ``kv_cache.gpu_memory_fraction`` of the memory free after the weights; and an engine
   that does not fit is the one out-of-memory line naming the settings to lower. On CPU
   only the placement row runs (the pool is host memory).
5. handoff: a sequence prefilled on the device, staged device -> host -> device into a
   second engine (what both KV strategies do on CUDA), decodes the same greedy tokens as
   the first engine going on alone. On CPU each runner's KV is cloned apart from its host
   array, so the copies still run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from triton_disagg.engine.block_pool import BlockPool
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import DTYPE_BYTES, Runtime, kv_budget
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.engine.spec import EngineSpec, ModelShape
from triton_disagg.engine.torch_model import TORCH_DTYPES, TorchModelRunner
from triton_disagg.engine.weights import load_engine
from triton_disagg.errors import UserError

from gpu_check_models import (ARCHITECTURES, LLAMA_SHAPES, TINY_LLAMA_SHAPES,
                              make_shape, make_spec, random_weights, write_tiny_engine)

LOW_PRECISION_LOGIT_TOLERANCE = 0.05    # max |logit diff| of bf16/fp16 vs fp32 at step one

# ---- 1. parity -------------------------------------------------------------------------

def parity_table(device: str, dtype: str, say) -> list[str]:
    lines = ["| architecture | runtime | greedy tokens equal to numpy CPU | first-step max |logit diff| | verdict |",
             "|---|---|---:|---:|---|"]
    prompt, n = list(range(3, 40)), 24
    with tempfile.TemporaryDirectory() as tmp:
        for name in ARCHITECTURES:
            engine_dir = write_tiny_engine(Path(tmp) / name, name)
            ref_engine = LLMEngine(engine_dir, num_blocks=8, runtime=Runtime("numpy"))
            ref = ref_engine.generate([prompt], SamplingParams(max_tokens=n))[0].output_ids
            ref_logits = first_logits(ref_engine, prompt)
            for run_dtype in dict.fromkeys(["float32", dtype]):
                engine = LLMEngine(engine_dir, num_blocks=8,
                                   runtime=Runtime("torch", device, run_dtype))
                got = engine.generate([prompt], SamplingParams(max_tokens=n))[0].output_ids
                same = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), n)
                diff = float(np.abs(first_logits(engine, prompt) - ref_logits).max())
                ok = same == n if run_dtype == "float32" else diff <= LOW_PRECISION_LOGIT_TOLERANCE
                lines.append(f"| {name} | torch {device} {run_dtype} | {same}/{n} | {diff:.2e} | "
                             f"{'ok' if ok else 'FAIL'} |")
                say(lines[-1])
    return lines


def first_logits(engine: LLMEngine, prompt: list[int]) -> np.ndarray:
    blocks = engine.pool.allocate(engine.pool.geometry.blocks_for(len(prompt)))
    try:
        return engine.runner.prefill([(prompt, blocks)])[0]
    finally:
        engine.pool.free(blocks)


# ---- 2. speed --------------------------------------------------------------------------

def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes/s moved (read + written) by the best of 5 copies of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def device_weights(shape: ModelShape, device: str, dtype: str) -> dict[str, torch.Tensor]:
    torch_dtype = TORCH_DTYPES[dtype]

    def make(name, dims):
        if len(dims) == 1:
            return torch.ones(dims, dtype=torch_dtype, device=device)
        return torch.randn(dims, dtype=torch_dtype, device=device) * 0.02

    return random_weights(shape, make)


def runner_speed(shape: ModelShape, weights, device: str, dtype: str, batch: int,
                 prompt_len: int, steps: int, repeats: int) -> tuple[float, float]:
    """Best (prefill tok/s of ``batch`` prompts, decode tok/s of ``steps`` batched steps)."""
    spec = make_spec(shape, prompt_len + steps + 1)
    per_seq = spec.block_geometry().blocks_for(prompt_len + steps + 1)
    pool = BlockPool(spec.block_geometry(), batch * per_seq)
    runner = TorchModelRunner(spec, weights, pool, device, dtype)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    prompts = [[(7 * b + i) % shape.vocab_size for i in range(prompt_len)] for b in range(batch)]
    best_prefill = best_decode = 0.0
    for attempt in range(repeats + 1):                     # attempt 0: warm-up
        sync(device)
        start = time.perf_counter()
        runner.prefill(list(zip(prompts, tables)))
        sync(device)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        for step in range(steps):
            runner.decode([1] * batch, [prompt_len + step] * batch, tables)
        sync(device)
        decode_s = time.perf_counter() - start
        if attempt:
            best_prefill = max(best_prefill, batch * prompt_len / prefill_s)
            best_decode = max(best_decode, batch * steps / decode_s)
    del runner
    return best_prefill, best_decode


def hf_speed(shape: ModelShape, device: str, dtype: str, batch: int, prompt_len: int,
             steps: int, repeats: int) -> tuple[float, float] | None:
    """Best (prefill tok/s, decode tok/s) of transformers generate, or None without it."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    config = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                         num_hidden_layers=shape.num_layers,
                         num_attention_heads=shape.num_heads,
                         num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                         intermediate_size=shape.intermediate_size,
                         tie_word_embeddings=shape.tie_word_embeddings,
                         max_position_embeddings=shape.max_position_embeddings)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(TORCH_DTYPES[dtype]).eval()
    ids = torch.randint(0, shape.vocab_size, (batch, prompt_len), device=device)   # [B, P]

    def timed(new_tokens: int) -> float:
        sync(device)
        start = time.perf_counter()
        model.generate(ids, do_sample=False, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, pad_token_id=0)
        sync(device)
        return time.perf_counter() - start

    best_prefill = best_decode = 0.0
    with torch.inference_mode():
        for attempt in range(repeats + 1):
            first = timed(1)
            whole = timed(steps + 1) if steps else first
            if attempt:
                best_prefill = max(best_prefill, batch * prompt_len / first)
                best_decode = max(best_decode, batch * steps / max(whole - first, 1e-9))
    del model
    return best_prefill, best_decode


def speed_table(device: str, dtype: str, tiny: bool, say) -> list[str]:
    shapes = TINY_LLAMA_SHAPES if tiny else LLAMA_SHAPES
    batches, steps, repeats = ((1, 4), 4, 1) if tiny else ((1, 16, 64), 32, 2)
    long_prompt, short_prompt = (64, 16) if tiny else (2000, 128)
    bandwidth = copy_bandwidth(device, (64 << 20) if tiny else (4 << 30))
    lines = [f"Copy bandwidth (read + write) on {device}: {bandwidth / 1e9:,.0f} GB/s; "
             f"{dtype}; decode {steps} steps after a {short_prompt}-token prompt; prefill of "
             f"one {long_prompt}-token prompt; best of {repeats} after a warm-up.", "",
             "| model | what | batch | torch runtime tok/s | transformers tok/s | ratio | "
             "weight-read limit tok/s | share of limit |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, kw in shapes.items():
        shape = make_shape(**kw)
        weights = device_weights(shape, device, dtype)
        weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())
        rows = [("prefill", 1, long_prompt)] + [("decode", b, short_prompt) for b in batches]
        for what, batch, prompt_len in rows:
            ours = runner_speed(shape, weights, device, dtype, batch, prompt_len,
                                steps if what == "decode" else 0, repeats)
            ours = ours[0] if what == "prefill" else ours[1]
            hf = hf_speed(shape, device, dtype, batch, prompt_len,
                          steps if what == "decode" else 0, repeats)
            theirs = None if hf is None else (hf[0] if what == "prefill" else hf[1])
            # A copy's traffic is half reads: the read rate is bandwidth / 2.
            limit = batch * bandwidth / 2 / weight_bytes if what == "decode" else None
            lines.append(
                f"| {name} | {what} | {batch} | {ours:,.1f} | "
                f"{'n/a' if theirs is None else f'{theirs:,.1f}'} | "
                f"{'n/a' if theirs is None else f'{ours / theirs:.2f}x'} | "
                f"{'' if limit is None else f'{limit:,.1f}'} | "
                f"{'' if limit is None else f'{ours / limit:.0%}'} |")
            say(lines[-1])
        del weights
    return lines


# ---- 3. nixl ---------------------------------------------------------------------------

def _nixl_owner(device: str, nbytes: int, conn) -> None:
    """The other process: a registered buffer on ``device``; sends its metadata and
    address, then waits until told to stop."""
    from nixl._api import nixl_agent, nixl_agent_config

    buf = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
    agent = nixl_agent("owner", nixl_agent_config(backends=["UCX"]))
    kind = "VRAM" if device == "cuda" else "DRAM"
    dev_id = buf.device.index or 0
    agent.register_memory([(buf.data_ptr(), nbytes, dev_id, "")], kind)
    conn.send((agent.get_agent_metadata(), buf.data_ptr(), dev_id))
    conn.recv()


def nixl_table(device: str, nbytes: int, repeats: int, say) -> list[str]:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        return [f"NIXL not importable here ({exc}); carry the nixl wheel to run this section."]
    kind = "VRAM" if device == "cuda" else "DRAM"
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    owner = ctx.Process(target=_nixl_owner, args=(device, nbytes, there), daemon=True)
    owner.start()
    try:
        metadata, remote_addr, remote_dev = here.recv()
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        agent = nixl_agent("reader", nixl_agent_config(backends=["UCX"]))
        local_dev = dst.device.index or 0
        agent.register_memory([(dst.data_ptr(), nbytes, local_dev, "")], kind)
        peer = agent.add_remote_agent(metadata)
        best_read = float("inf")
        for attempt in range(repeats + 1):
            xfer = agent.initialize_xfer(
                "READ", agent.get_xfer_descs([(dst.data_ptr(), nbytes, local_dev)], kind),
                agent.get_xfer_descs([(remote_addr, nbytes, remote_dev)], kind), peer)
            start = time.perf_counter()
            state = agent.transfer(xfer)
            while state == "PROC":
                state = agent.check_xfer_state(xfer)
            elapsed = time.perf_counter() - start
            agent.release_xfer_handle(xfer)
            if state != "DONE":
                raise RuntimeError(f"NIXL READ ended in state {state}")
            if attempt:
                best_read = min(best_read, elapsed)
        if int(dst[-1]) != 7:
            raise RuntimeError("NIXL READ finished but the bytes did not arrive")
        local_copy = 2 / copy_bandwidth(device, nbytes) * nbytes   # seconds for one copy
    finally:
        here.send("stop")
        owner.join(timeout=30)
    lines = [f"{nbytes / 2**20:,.0f} MiB of {kind}; best of {repeats} after a warm-up.", "",
             "| transfer | seconds | GB/s (bytes moved / s) |", "|---|---:|---:|",
             f"| NIXL READ from another process (UCX, {kind}) | {best_read:.4f} | "
             f"{nbytes / best_read / 1e9:,.1f} |",
             f"| copy within one process ({device}) | {local_copy:.4f} | "
             f"{nbytes / local_copy / 1e9:,.1f} |"]
    for line in lines[-2:]:
        say(line)
    return lines


# ---- 4. memory -------------------------------------------------------------------------

MEMORY_CHECK_FRACTION = 0.05   # small, so that the host's shadow pool array stays small too


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
        if device != "cuda":
            return lines
        weight_bytes = sum(w.size for w in load_engine(engine_dir)[1].values()) * (
            DTYPE_BYTES[dtype])
        pool_bytes = engine.pool.num_total * runtime.kv_block_bytes(engine.pool.geometry)
        expected = kv_budget(free_before, None, weight_bytes, MEMORY_CHECK_FRACTION)
        row(f"KV pool at gpu_memory_fraction {MEMORY_CHECK_FRACTION}",
            f"{expected / 2**30:.2f} GiB", f"{pool_bytes / 2**30:.2f} GiB",
            abs(pool_bytes - expected) <= 0.02 * expected)
        del engine
        torch.cuda.empty_cache()
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
            torch.cuda.empty_cache()
        row("1 GiB pool with 64 MiB free", "one line naming kv_cache.gpu_memory_fraction",
            got.replace("|", "/"), ok)
    return lines


# ---- 5. KV handoff staged through host memory ---------------------------------------

def handoff_table(device: str, dtype: str, say) -> list[str]:
    """A sequence prefilled by one engine on ``device`` and handed to another through the
    host mirrors (``blocks_to_host``, the bytes a KV connector moves, ``blocks_to_device``)
    decodes the same greedy tokens as the first engine going on alone."""
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
        context.blocks_to_host(src)
        generation.pool.array[dst] = context.pool.array[src]     # what a connector moves
        generation.blocks_to_device(dst)
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


def engine_pool_block_bytes(engine_dir: Path) -> int:
    return EngineSpec.load(engine_dir).block_geometry().block_nbytes


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

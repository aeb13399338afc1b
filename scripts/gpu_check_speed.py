"""scripts/gpu_check.py, section "speed": decode tok/s at batch 1, 16, 64 and prefill tok/s of
a 2000-token prompt for Llama-3.2-1B- and Llama-3-8B-shaped models with random weights made
on the device, beside transformers (same shapes, same dtype, its own cache) and the weight-
read limit (:func:`weight_read_limit`); logits go to the host every step, as the engine
samples there.
"""

from __future__ import annotations

import time

import torch

from triton_disagg.engine.block_pool import BlockPool
from triton_disagg.engine.spec import ModelShape
from triton_disagg.engine.torch_device import TORCH_DTYPES
from triton_disagg.engine.torch_model import TorchModelRunner

from gpu_check_models import LLAMA_SHAPES, TINY_LLAMA_SHAPES, make_shape, make_spec, random_weights


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


def weight_read_limit(batch: int, copy_bytes_per_s: float, weight_bytes: int) -> float:
    """Decode tok/s of ``batch`` sequences if a step took only the time to read every weight
    once: ``batch / (weight_bytes / copy_bytes_per_s)``. ``copy_bytes_per_s`` is
    :func:`copy_bandwidth`'s, which already counts a copy's reads and writes: the memory's
    whole rate, which a weight read (reads only) gets too, so it is not halved."""
    return batch * copy_bytes_per_s / weight_bytes


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
    pool = BlockPool(spec.block_geometry(), batch * per_seq, host_array=device == "cpu")
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
            limit = weight_read_limit(batch, bandwidth, weight_bytes) if what == "decode" \
                else None
            lines.append(
                f"| {name} | {what} | {batch} | {ours:,.1f} | "
                f"{'n/a' if theirs is None else f'{theirs:,.1f}'} | "
                f"{'n/a' if theirs is None else f'{ours / theirs:.2f}x'} | "
                f"{'' if limit is None else f'{limit:,.1f}'} | "
                f"{'' if limit is None else f'{ours / limit:.0%}'} |")
            say(lines[-1])
        del weights
    return lines

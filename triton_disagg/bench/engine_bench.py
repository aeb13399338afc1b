"""Engine throughput: the numpy engine beside transformers on the same checkpoints, in one run.

For each model and batch size it measures prefill tokens/s (one batched prefill of
``batch`` prompts of ``prompt_len`` tokens) and decode tokens/s (``new_tokens - 1``
batched decode steps after it), for the engine (``LLMEngine.step``, greedy, sampling
included) and for transformers (torch CPU, same thread count, its own KV cache). It
also measures the machine's matrix-vector bandwidth and reports batch-1 decode as a
share of the roofline. Only ratios measured in the same run are meaningful here: the
machines are shared and noisy.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from triton_disagg.bench.hf_baseline import hf_throughput
from triton_disagg.bench.roofline import (decode_weight_bytes, measure_matvec_bandwidth,
                                          roofline_tokens_per_second)

GPT2_SMALL = {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}


@dataclass(frozen=True)
class BenchRow:
    model: str
    batch: int
    engine_prefill: float   # tokens/s
    hf_prefill: float
    engine_decode: float
    hf_decode: float


def write_gpt2_small_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A randomly initialised GPT-2-small-shaped checkpoint (124M parameters), built once."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from triton_disagg.builders.demo import write_demo_tokenizer

    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**GPT2_SMALL))
    model.save_pretrained(directory)
    write_demo_tokenizer(directory)  # ids are fed directly; only the builder needs the file
    return directory


def engine_throughput(engine_dir: Path, batch: int, prompt_len: int, new_tokens: int,
                      threads: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of the numpy engine on ``engine_dir``."""
    from threadpoolctl import threadpool_limits

    from triton_disagg.engine.llm_engine import LLMEngine
    from triton_disagg.engine.sampling import SamplingParams

    engine = LLMEngine(engine_dir, num_blocks=_blocks_needed(engine_dir, batch, prompt_len + new_tokens))
    vocab = engine.spec.shape.vocab_size
    prompts = np.random.default_rng(0).integers(0, vocab, (batch, prompt_len))  # [B, P]
    params = SamplingParams(max_tokens=new_tokens, end_id=None)
    with threadpool_limits(threads):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"bench-{i}", prompt.tolist(), params)
        start = time.perf_counter()
        first = engine.step()  # one batched prefill of every prompt
        prefill_s = time.perf_counter() - start
        assert len(first) == batch, "the engine did not prefill the whole batch in one pass"
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        decode_s = time.perf_counter() - start
    return batch * prompt_len / prefill_s, batch * (new_tokens - 1) / decode_s


def _blocks_needed(engine_dir: Path, batch: int, tokens: int) -> int:
    from triton_disagg.engine.spec import EngineSpec

    per_block = EngineSpec.load(engine_dir).kv.tokens_per_block
    return batch * -(-tokens // per_block)


def bench_model(name: str, checkpoint: Path, engine_dir: Path, batches: list[int],
                prompt_len: int, new_tokens: int, threads: int, say) -> list[BenchRow]:
    from triton_disagg.engine.spec import EngineSpec

    vocab = EngineSpec.load(engine_dir).shape.vocab_size
    rows = []
    for batch in batches:
        say(f"[bench] {name} batch {batch}: engine ...")
        engine = engine_throughput(engine_dir, batch, prompt_len, new_tokens, threads)
        say(f"[bench] {name} batch {batch}: transformers ...")
        hf = hf_throughput(checkpoint, batch, prompt_len, new_tokens - 1, threads, vocab)
        rows.append(BenchRow(name, batch, engine[0], hf[0], engine[1], hf[1]))
        say(f"[bench] {name} batch {batch}: decode {engine[1]:.0f} tok/s vs {hf[1]:.0f} tok/s")
    return rows


def default_threads() -> int:
    return len(os.sched_getaffinity(0))


def format_report(rows: list[BenchRow], rooflines: dict[str, tuple[int, float]],
                  bandwidth: float, threads: int, prompt_len: int, new_tokens: int) -> str:
    """Markdown: the throughput table, then the batch-1 roofline per model."""
    lines = [
        f"Prompt {prompt_len} tokens, {new_tokens} new tokens (greedy), {threads} threads for "
        "both implementations, float32. Ratios are engine / transformers in the same run.",
        "",
        "| model | batch | prefill tok/s (engine) | prefill tok/s (transformers) | ratio "
        "| decode tok/s (engine) | decode tok/s (transformers) | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.batch} | {r.engine_prefill:,.0f} | {r.hf_prefill:,.0f} | "
            f"{r.engine_prefill / r.hf_prefill:.2f}x | {r.engine_decode:,.1f} | "
            f"{r.hf_decode:,.1f} | {r.engine_decode / r.hf_decode:.2f}x |")
    lines += ["", f"Measured matrix-vector read bandwidth: {bandwidth / 1e9:.1f} GB/s.", "",
              "| model | weight MB read per token | batch-1 roofline tok/s "
              "| engine batch-1 decode tok/s | share of roofline |",
              "|---|---:|---:|---:|---:|"]
    for model, (weight_bytes, roofline) in rooflines.items():
        batch1 = next((r for r in rows if r.model == model and r.batch == 1), None)
        if batch1 is None:
            continue
        lines.append(f"| {model} | {weight_bytes / 1e6:,.0f} | {roofline:,.1f} | "
                     f"{batch1.engine_decode:,.1f} | {batch1.engine_decode / roofline:.0%} |")
    lines += _target_lines(rows, rooflines)
    return "\n".join(lines) + "\n"


def _target_lines(rows: list[BenchRow], rooflines: dict[str, tuple[int, float]]) -> list[str]:
    """Markdown bullets: the issue's decode targets on GPT-2-small, held or missed.

    Also states transformers' own share of the roofline: no implementation can beat it
    by more than ``1 / share`` at batch 1, which bounds the reachable batch-1 ratio.
    """
    by_batch = {r.batch: r for r in rows if r.model == "gpt2-small"}
    if "gpt2-small" not in rooflines or 1 not in by_batch:
        return []
    roofline = rooflines["gpt2-small"][1]
    one = by_batch[1]

    def verdict(ok: bool) -> str:
        return "holds" if ok else "misses"

    ratio1, share1 = one.engine_decode / one.hf_decode, one.engine_decode / roofline
    hf_share = one.hf_decode / roofline
    lines = ["", "Targets on GPT-2-small (decode):", "",
             f"- batch 1 at least 3x transformers: {ratio1:.2f}x, {verdict(ratio1 >= 3)}. "
             f"transformers itself runs at {hf_share:.0%} of the roofline here, so no "
             f"implementation can exceed {1 / hf_share:.1f}x at batch 1 on this machine.",
             f"- batch 1 at least 75% of the roofline: {share1:.0%}, {verdict(share1 >= 0.75)}."]
    if 8 in by_batch:
        ratio8 = by_batch[8].engine_decode / by_batch[8].hf_decode
        lines.append(f"- batch 8 at least 2x transformers: {ratio8:.2f}x, {verdict(ratio8 >= 2)}.")
    return lines


def run_engine_bench(models: dict[str, tuple[Path, Path]], batches: list[int], prompt_len: int,
                     new_tokens: int, threads: int, say) -> str:
    """Bench every ``name -> (checkpoint, engine_dir)`` and return the markdown report."""
    from threadpoolctl import threadpool_limits

    from triton_disagg.engine.spec import EngineSpec

    with threadpool_limits(threads):
        bandwidth = measure_matvec_bandwidth()
    say(f"[bench] matrix-vector bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows, rooflines = [], {}
    for name, (checkpoint, engine_dir) in models.items():
        shape = EngineSpec.load(engine_dir).shape
        rooflines[name] = (decode_weight_bytes(shape), roofline_tokens_per_second(shape, bandwidth))
        rows += bench_model(name, checkpoint, engine_dir, batches, prompt_len, new_tokens,
                            threads, say)
    return format_report(rows, rooflines, bandwidth, threads, prompt_len, new_tokens)

"""Engine throughput: the engine's runners (numpy, torch) beside transformers on the same
checkpoints, in one run.

For each model and batch size it measures prefill tokens/s (one batched prefill of
``batch`` prompts of ``prompt_len`` tokens) and decode tokens/s (``new_tokens - 1``
batched decode steps after it), for the engine on each runtime (``LLMEngine.step``,
greedy, sampling included) and for transformers (torch CPU, same thread count, its own
KV cache); each after one warm-up pass, the best of ``repeats`` passes. It also
measures the machine's matrix-vector bandwidth and reports batch-1 decode as a share of
the roofline. Only ratios measured in the same run are meaningful here: the machines
are shared and noisy.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from triton_disagg.bench.best_of import best_rates
from triton_disagg.bench.hf_baseline import hf_throughput
from triton_disagg.engine.runtime import DEFAULT_CPU_RUNTIME
from triton_disagg.bench.roofline import (decode_weight_bytes, measure_matvec_bandwidth,
                                          roofline_tokens_per_second)

GPT2_SMALL = {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}


HF = "transformers"


@dataclass(frozen=True)
class BenchRow:
    """Tokens/s of one model at one batch size, keyed by implementation (a runtime or HF)."""

    model: str
    batch: int
    prefill: dict[str, float]
    decode: dict[str, float]

    @property
    def runtimes(self) -> list[str]:
        return [name for name in self.decode if name != HF]


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


def engine_throughput(engine_dir: Path, runtime: str, batch: int, prompt_len: int,
                      new_tokens: int, threads: int, repeats: int) -> tuple[float, float]:
    """Best (prefill tokens/s, decode tokens/s) of the engine on ``runtime`` (CPU) over
    ``repeats`` passes after one warm-up pass."""
    import torch
    from threadpoolctl import threadpool_limits

    from triton_disagg.engine.llm_engine import LLMEngine
    from triton_disagg.engine.runtime import Runtime
    from triton_disagg.engine.sampling import SamplingParams

    engine = LLMEngine(engine_dir, num_blocks=_blocks_needed(engine_dir, batch, prompt_len + new_tokens),
                       runtime=Runtime(runtime, "cpu"))
    torch.set_num_threads(threads)
    vocab = engine.spec.shape.vocab_size
    prompts = np.random.default_rng(0).integers(0, vocab, (batch, prompt_len))  # [B, P]
    params = SamplingParams(max_tokens=new_tokens, end_id=None)

    def one_pass(attempt: int) -> tuple[float, float]:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"bench-{attempt}-{i}", prompt.tolist(), params)
        start = time.perf_counter()
        first = engine.step()  # one batched prefill of every prompt
        prefill_s = time.perf_counter() - start
        assert len(first) == batch, "the engine did not prefill the whole batch in one pass"
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return prefill_s, time.perf_counter() - start

    with threadpool_limits(threads):
        return best_rates(one_pass, repeats, batch * prompt_len, batch * (new_tokens - 1))


def _blocks_needed(engine_dir: Path, batch: int, tokens: int) -> int:
    from triton_disagg.engine.spec import EngineSpec

    per_block = EngineSpec.load(engine_dir).kv.tokens_per_block
    return batch * -(-tokens // per_block)


def bench_model(name: str, checkpoint: Path, engine_dir: Path, runtimes: list[str],
                batches: list[int], prompt_len: int, new_tokens: int, threads: int,
                repeats: int, say) -> list[BenchRow]:
    from triton_disagg.engine.spec import EngineSpec

    vocab = EngineSpec.load(engine_dir).shape.vocab_size
    rows = []
    for batch in batches:
        prefill, decode = {}, {}
        for runtime in runtimes:
            say(f"{name} batch {batch}: {runtime} ...")
            prefill[runtime], decode[runtime] = engine_throughput(
                engine_dir, runtime, batch, prompt_len, new_tokens, threads, repeats)
        say(f"{name} batch {batch}: transformers ...")
        prefill[HF], decode[HF] = hf_throughput(checkpoint, batch, prompt_len, new_tokens - 1,
                                                threads, vocab, repeats)
        rows.append(BenchRow(name, batch, prefill, decode))
        say(f"{name} batch {batch}: decode tok/s " +
            ", ".join(f"{k} {v:.0f}" for k, v in decode.items()))
    return rows


def default_threads() -> int:
    return len(os.sched_getaffinity(0))


def format_report(rows: list[BenchRow], rooflines: dict[str, tuple[int, float]],
                  bandwidth: float, threads: int, prompt_len: int, new_tokens: int,
                  repeats: int = 1) -> str:
    """Markdown: one throughput table per runtime (beside transformers), then the batch-1
    roofline per model and runtime, then the targets."""
    lines = [
        f"Prompt {prompt_len} tokens, {new_tokens} new tokens (greedy), {threads} threads for "
        f"every implementation, float32, CPU; each figure the best of {repeats} passes after "
        f"a warm-up. Ratios are runtime / transformers in the same run."]
    for runtime in rows[0].runtimes if rows else []:
        lines += [
            "", f"`{runtime}` runtime:", "",
            f"| model | batch | prefill tok/s ({runtime}) | prefill tok/s (transformers) | ratio "
            f"| decode tok/s ({runtime}) | decode tok/s (transformers) | ratio |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            p, d = r.prefill[runtime], r.decode[runtime]
            lines.append(
                f"| {r.model} | {r.batch} | {p:,.0f} | {r.prefill[HF]:,.0f} | "
                f"{p / r.prefill[HF]:.2f}x | {d:,.1f} | {r.decode[HF]:,.1f} | "
                f"{d / r.decode[HF]:.2f}x |")
    lines += ["", f"Measured matrix-vector read bandwidth: {bandwidth / 1e9:.1f} GB/s.", "",
              "| model | runtime | weight MB read per token | batch-1 roofline tok/s "
              "| batch-1 decode tok/s | share of roofline |",
              "|---|---|---:|---:|---:|---:|"]
    for model, (weight_bytes, roofline) in rooflines.items():
        batch1 = next((r for r in rows if r.model == model and r.batch == 1), None)
        if batch1 is None:
            continue
        for name, decode in batch1.decode.items():
            lines.append(f"| {model} | {name} | {weight_bytes / 1e6:,.0f} | {roofline:,.1f} | "
                         f"{decode:,.1f} | {decode / roofline:.0%} |")
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
    engine = DEFAULT_CPU_RUNTIME if DEFAULT_CPU_RUNTIME in one.decode else one.runtimes[0]

    def verdict(ok: bool) -> str:
        return "holds" if ok else "misses"

    def ratio(row: BenchRow, runtime: str) -> float:
        return row.decode[runtime] / row.decode[HF]

    ratio1, share1 = ratio(one, engine), one.decode[engine] / roofline
    hf_share = one.decode[HF] / roofline
    lines = ["", f"Targets on GPT-2-small (decode; the engine = the default CPU runtime, "
                 f"`{engine}`):", "",
             f"- batch 1 at least 3x transformers: {ratio1:.2f}x, {verdict(ratio1 >= 3)}. "
             f"transformers itself runs at {hf_share:.0%} of the roofline here, so no "
             f"implementation can exceed {1 / hf_share:.1f}x at batch 1 on this machine.",
             f"- batch 1 at least 75% of the roofline: {share1:.0%}, {verdict(share1 >= 0.75)}."]
    if 8 in by_batch:
        ratio8 = ratio(by_batch[8], engine)
        lines.append(f"- batch 8 at least 2x transformers: {ratio8:.2f}x, {verdict(ratio8 >= 2)}.")
    if "torch" in one.decode:
        lines += [f"- torch runtime at least transformers at batch {b}: "
                  f"{ratio(r, 'torch'):.2f}x, {verdict(ratio(r, 'torch') >= 1)}."
                  for b, r in sorted(by_batch.items())]
    return lines


def run_engine_bench(models: dict[str, tuple[Path, Path]], runtimes: list[str],
                     batches: list[int], prompt_len: int, new_tokens: int, threads: int,
                     repeats: int, say) -> str:
    """Bench every ``name -> (checkpoint, engine_dir)`` and return the markdown report."""
    from threadpoolctl import threadpool_limits

    from triton_disagg.engine.spec import EngineSpec

    with threadpool_limits(threads):
        bandwidth = measure_matvec_bandwidth()
    say(f"matrix-vector bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows, rooflines = [], {}
    for name, (checkpoint, engine_dir) in models.items():
        shape = EngineSpec.load(engine_dir).shape
        rooflines[name] = (decode_weight_bytes(shape), roofline_tokens_per_second(shape, bandwidth))
        rows += bench_model(name, checkpoint, engine_dir, runtimes, batches, prompt_len,
                            new_tokens, threads, repeats, say)
    return format_report(rows, rooflines, bandwidth, threads, prompt_len, new_tokens, repeats)

"""scripts/gpu_check.py, section "parity": greedy tokens of the five architectures (random tiny
engines written here).

- float32: the runtime on ``--device`` against the numpy runner on CPU (the reference the
  unit tests hold to Hugging Face): the greedy tokens must match exactly.
- ``--dtype`` (bfloat16/float16): against float32 on the same device, over the prefill AND
  ``DECODE_STEPS`` greedy decode steps, once with torch's default SDPA backends (cuDNN
  allowed) and once with serving's (cuDNN off). Low precision rounds every matmul, so a
  near-tie may flip a token; it passes when the first-step logits are within
  ``LOW_PRECISION_LOGIT_TOLERANCE`` of float32 and either every step's greedy token
  equals float32's or the first that differs is a near-tie: float32's own logit margin of
  its token over the one chosen is under ``DIVERGENCE_MARGIN_TOLERANCE``
  (:func:`judge_low_precision`).

Each low-precision row names the SDPA backend that ran (``gpu_check_attention``).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import Runtime
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.engine.torch_model import TorchModelRunner

from gpu_check_attention import BACKEND_CHOICES, sdpa_backends_ran
from gpu_check_models import ARCHITECTURES, write_tiny_engine


LOW_PRECISION_LOGIT_TOLERANCE = 0.05    # max |logit diff| of bf16/fp16 vs fp32 at step one
DIVERGENCE_MARGIN_TOLERANCE = 0.1       # a flip is a near-tie if fp32's margin is under this
DECODE_STEPS = 24                       # greedy tokens compared (prefill's + decode steps)
PROMPT = list(range(3, 40))


@dataclass(frozen=True)
class LowPrecisionVerdict:
    equal_steps: int             # leading greedy tokens equal to float32's
    first_step_diff: float       # max |logit diff| at the prefill's token
    max_diff: float              # max |logit diff| over the equal steps
    margin: float | None         # float32's margin at the first divergence (None: none)

    @property
    def ok(self) -> bool:
        explained = self.margin is None or self.margin < DIVERGENCE_MARGIN_TOLERANCE
        return self.first_step_diff <= LOW_PRECISION_LOGIT_TOLERANCE and explained


def judge_low_precision(ref_tokens: list[int], ref_logits: np.ndarray, tokens: list[int],
                        logits: np.ndarray) -> LowPrecisionVerdict:
    """Compare a low-precision greedy run (``tokens``, per-step ``logits`` ``[steps, V]``)
    with float32's. Up to the first differing token both runs saw the same inputs, so
    their logits compare step by step; at that step float32's margin is
    ``ref_logits[step, its token] - ref_logits[step, low precision's token]`` (>= 0)."""
    steps = min(len(ref_tokens), len(tokens))
    equal = next((i for i in range(steps) if ref_tokens[i] != tokens[i]), steps)
    compared = max(equal, 1)
    diffs = np.abs(logits[:compared] - ref_logits[:compared]).max(axis=1)    # [compared]
    margin = None
    if equal < steps:
        row = ref_logits[equal]
        margin = float(row[ref_tokens[equal]] - row[tokens[equal]])
    return LowPrecisionVerdict(equal, float(diffs[0]), float(diffs.max()), margin)


def greedy_run(runner: TorchModelRunner, prompt: list[int], steps: int
               ) -> tuple[list[int], np.ndarray]:
    """``steps`` greedy tokens of ``prompt`` on ``runner`` (prefill, then decode) and the
    logits each was taken from ``[steps, V]``; uses the runner's first blocks."""
    blocks = list(range(runner.pool.geometry.blocks_for(len(prompt) + steps)))
    rows = [runner.prefill([(prompt, blocks)])[0]]
    tokens = [int(np.argmax(rows[-1]))]
    for step in range(steps - 1):
        rows.append(runner.decode([tokens[-1]], [len(prompt) + step], [blocks])[0])
        tokens.append(int(np.argmax(rows[-1])))
    return tokens, np.stack(rows)                                        # [steps, V]


def parity_table(device: str, dtype: str, say) -> list[str]:
    n = DECODE_STEPS
    lines = [f"float32 vs the numpy runner on CPU: {n} greedy tokens must be equal. {dtype} vs "
             f"float32 on {device}: first-step max |logit diff| <= "
             f"{LOW_PRECISION_LOGIT_TOLERANCE}, and {n} greedy tokens equal or the first "
             f"that differs a near-tie (float32's margin < {DIVERGENCE_MARGIN_TOLERANCE}).", "",
             "| architecture | runtime | SDPA backends | backend that ran | greedy tokens equal "
             "| first-step max |logit diff| | max |logit diff| while equal | float32 margin at "
             "first difference | verdict |",
             "|---|---|---|---|---:|---:|---:|---:|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in ARCHITECTURES:
            engine_dir = write_tiny_engine(Path(tmp) / name, name)
            ref_engine = LLMEngine(engine_dir, num_blocks=8, runtime=Runtime("numpy"))
            ref = ref_engine.generate([PROMPT], SamplingParams(max_tokens=n))[0].output_ids
            ref_logits = first_logits(ref_engine, PROMPT)
            fp32 = LLMEngine(engine_dir, num_blocks=8, runtime=Runtime("torch", device))
            got = fp32.generate([PROMPT], SamplingParams(max_tokens=n))[0].output_ids
            same = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), n)
            diff = float(np.abs(first_logits(fp32, PROMPT) - ref_logits).max())
            lines.append(f"| {name} | torch {device} float32 | serving | "
                         f"{sdpa_backends_ran(lambda: first_logits(fp32, PROMPT))} | {same}/{n} | "
                         f"{diff:.2e} | | | {'ok' if same == n else 'FAIL'} |")
            say(lines[-1])
            if dtype == "float32":
                continue
            fp32_tokens, fp32_logits = greedy_run(fp32.runner, PROMPT, n)
            for label, backends in BACKEND_CHOICES.items():
                runner = low_precision_runner(engine_dir, device, dtype, backends)
                ran = sdpa_backends_ran(lambda: greedy_run(runner, PROMPT, 2))
                verdict = judge_low_precision(fp32_tokens, fp32_logits,
                                              *greedy_run(runner, PROMPT, n))
                margin = "" if verdict.margin is None else f"{verdict.margin:.3f}"
                lines.append(f"| {name} | torch {device} {dtype} | {label} | {ran} | "
                             f"{verdict.equal_steps}/{n} | {verdict.first_step_diff:.2e} | "
                             f"{verdict.max_diff:.2e} | {margin} | "
                             f"{'ok' if verdict.ok else 'FAIL'} |")
                say(lines[-1])
                del runner
    return lines


def low_precision_runner(engine_dir: Path, device: str, dtype: str, backends
                         ) -> TorchModelRunner:
    """A ``dtype`` runner of the engine on ``device`` whose SDPA may use ``backends`` (None:
    torch's choice). Built directly so that the CPU smoke run exercises it too (the
    engine's Runtime allows 16-bit dtypes on CUDA only)."""
    from triton_disagg.engine.block_pool import BlockPool
    from triton_disagg.engine.weights import load_engine

    spec, weights = load_engine(engine_dir)
    pool = BlockPool(spec.block_geometry(), 8, host_array=device == "cpu")
    return TorchModelRunner(spec, weights, pool, device, dtype, sdpa_backends=backends)


def first_logits(engine: LLMEngine, prompt: list[int]) -> np.ndarray:
    blocks = engine.pool.allocate(engine.pool.geometry.blocks_for(len(prompt)))
    try:
        return engine.runner.prefill([(prompt, blocks)])[0]
    finally:
        engine.pool.free(blocks)

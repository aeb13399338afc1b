"""scripts/gpu_check.py, section "parity": greedy tokens of the five architectures (random tiny
engines written here), the runtime on ``--device`` in float32 and in ``--dtype`` against the
numpy runner on CPU (float32, the reference the unit tests hold to Hugging Face). float32
must match exactly; bfloat16/float16 round every matmul, so a near-tie may flip a token: the
table gives the matching prefix and the largest first-step logit difference (tolerance
stated there, ``LOW_PRECISION_LOGIT_TOLERANCE``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import Runtime
from triton_disagg.engine.sampling import SamplingParams

from gpu_check_models import ARCHITECTURES, write_tiny_engine


LOW_PRECISION_LOGIT_TOLERANCE = 0.05    # max |logit diff| of bf16/fp16 vs fp32 at step one


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

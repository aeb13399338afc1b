"""The transformers (torch CPU) baseline: prefill and decode tokens/s on the same checkpoint.

Decode runs the model's own forward with its KV cache, one token per step for the
whole batch, exactly the work the numpy engine does per step; the thread count is
set to the engine's so the ratio compares implementations, not core counts.
"""

from __future__ import annotations

import time
from pathlib import Path

from triton_disagg.bench.best_of import best_rates


def hf_throughput(checkpoint: Path, batch: int, prompt_len: int, new_tokens: int,
                  threads: int, vocab_size: int, repeats: int = 1) -> tuple[float, float]:
    """Best (prefill tokens/s, decode tokens/s) of transformers on ``checkpoint`` over
    ``repeats`` passes after one warm-up pass."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.eval()
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab_size, (batch, prompt_len), generator=generator)  # [B, P]
    return best_rates(lambda _: _one_pass(model, prompt, new_tokens), repeats,
                      batch * prompt_len, batch * new_tokens)


def _one_pass(model, prompt, new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one greedy pass over ``prompt`` ``[B, P]``."""
    import torch

    with torch.inference_mode():
        start = time.perf_counter()
        out = model(input_ids=prompt, use_cache=True)
        prefill_s = time.perf_counter() - start
        cache = out.cache
        token = out.logits[:, -1:].argmax(-1)  # [B, 1]
        start = time.perf_counter()
        for _ in range(new_tokens):
            out = model(input_ids=token, cache=cache, use_cache=True)
            cache = out.cache
            token = out.logits[:, -1:].argmax(-1)  # [B, 1]
        decode_s = time.perf_counter() - start
    return prefill_s, decode_s

"""Best-of-N timing shared by the engine and transformers throughput measurements."""

from __future__ import annotations

from typing import Callable


def best_rates(one_pass: Callable[[int], tuple[float, float]], repeats: int,
               prefill_tokens: int, decode_tokens: int) -> tuple[float, float]:
    """Best (prefill tokens/s, decode tokens/s) of ``repeats`` calls of ``one_pass(attempt)``
    (which returns its prefill and decode seconds), after one warm-up call (attempt 0):
    on a shared machine the fastest pass is the one least disturbed."""
    best_prefill = best_decode = 0.0
    for attempt in range(repeats + 1):
        prefill_s, decode_s = one_pass(attempt)
        if attempt:
            best_prefill = max(best_prefill, prefill_tokens / prefill_s)
            best_decode = max(best_decode, decode_tokens / decode_s)
    return best_prefill, best_decode

"""The one timing harness for the copies that ``bench handoff`` sets beside the server's
handoff: a copy's best GB/s over repeated calls on the same bytes.

Invariant: every figure is cache-hot (the same source and destination each call, after
untimed warm-up calls) and the fastest call, never a mean.
"""

from __future__ import annotations

import time
from typing import Callable


def best_gbps(copy: Callable[[], object], nbytes: int, repeats: int = 50,
              warmup: int = 2) -> float:
    """GB/s of ``copy``, which moves ``nbytes`` per call: the fastest of ``repeats`` timed
    calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        copy()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        copy()
        seconds.append(time.perf_counter() - start)
    return nbytes / min(seconds) / 1e9

"""Run part of a benchmark on given cores: every thread of this process, then back.

Invariant: inside :func:`pinned` every thread of the process (those started inside too)
runs only on the cores given; on exit every thread is back on the cores the calling
thread had on entry. No cores given: nothing changes.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Sequence

from triton_disagg.triton.placement import set_affinity


@contextlib.contextmanager
def pinned(cores: Sequence[int]) -> Iterator[None]:
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    set_affinity(set(cores))
    try:
        yield
    finally:
        set_affinity(before)

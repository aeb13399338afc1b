"""The memory allocator tritonserver and its stubs run with.

Triton's release notes list it as a known issue: glibc's malloc may keep freed memory
instead of returning it to the system, a false leak, and the fix is another allocator
in ``LD_PRELOAD``. Measured here (``serve all``, bursts of 64 streamed requests):
tritonserver's private memory grew by about 0.6 MiB per burst, without end, under
glibc, and stopped growing after five bursts under jemalloc. Under the 10-minute soak's
mix (cancels, SSE, bad inputs) it still creeps up by 1-2 KiB per request with either
allocator (docs/benchmarks.md), which is not explained yet. ``serve`` preloads jemalloc
when the host has it (Debian/Ubuntu package ``libjemalloc2``, which
``triton-disagg doctor --install`` installs as root).

Invariant: an ``LD_PRELOAD`` already in the environment is kept, after jemalloc.
"""

from __future__ import annotations

import ctypes.util

PACKAGE = "libjemalloc2"


def jemalloc() -> str | None:
    """The jemalloc shared library's name as the dynamic loader finds it, or None."""
    return ctypes.util.find_library("jemalloc")


def preload(env: dict[str, str], library: str | None) -> None:
    """Put ``library`` (when given) first in ``env``'s ``LD_PRELOAD``."""
    if library is None:
        return
    rest = [lib for lib in env.get("LD_PRELOAD", "").split() if lib != library]
    env["LD_PRELOAD"] = " ".join([library, *rest])

"""Per-instance setup: pin the stub process to its cores and cap its BLAS threads; on a
GPU instance, which CUDA device it runs on (:func:`gpu_index`).

The stub has imported numpy (and started its BLAS thread pool) before the
model's ``initialize`` runs, so environment variables are too late: the
affinity is set on every existing thread of the process (new threads inherit
it) and the BLAS pools are limited with threadpoolctl.

Invariant: with cores given, every thread of the process may run only on them
and BLAS uses at most one thread per core; with none, nothing changes.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from threadpoolctl import threadpool_limits


def instance_index(model_instance_name: str) -> int:
    """``generation_0_1`` -> 1 (Triton names instances ``<model>_<group>_<index>``)."""
    tail = model_instance_name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def cores_for(per_instance: Sequence[Sequence[int]], args: dict) -> tuple[int, ...]:
    """This instance's cores of ``per_instance`` (cores by instance index; settings'
    ``instance_cpus``); () when it has none."""
    index = instance_index(args.get("model_instance_name", ""))
    return tuple(per_instance[index]) if index < len(per_instance) else ()


def gpu_index(args: dict) -> int | None:
    """The CUDA device id Triton gave a ``KIND_GPU`` instance (``gpus:`` of its role puts
    one instance on each listed GPU); None for a ``KIND_CPU`` instance."""
    if args.get("model_instance_kind") != "GPU":
        return None
    return int(args["model_instance_device_id"])


def pin(cores: Sequence[int]) -> threadpool_limits | None:
    """Apply the invariant above; returns the threadpoolctl limiter (keep it alive) or None."""
    if not cores:
        return None
    mask = set(cores)
    set_affinity(mask)
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=len(mask))


def set_affinity(mask: set[int]) -> None:
    """Every existing thread of this process may run only on ``mask`` (new ones inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mask)
        except OSError:
            pass  # a thread that ended meanwhile

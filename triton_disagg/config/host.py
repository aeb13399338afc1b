"""Fitting a loaded :class:`~triton_disagg.config.disagg.DisaggConfig` to the host that
serves it: GPUs and cores that must exist here (:func:`check_host`), the guide's
``serve context|generation --gpus 0,1`` override (:func:`with_gpus_flag`), and the front
end's cores (:func:`front_cpus`).

Invariants: loading a config never looks at the host, so a config written for a GPU cluster
loads (and renders) on a laptop; these functions do, and every refusal is one
:class:`UserError` line naming the key or flag and the fix.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Collection, Optional, Sequence

from triton_disagg.config.disagg import DisaggConfig
from triton_disagg.config.roles import ENGINE_ROLES, PLACED_ROLES, Role
from triton_disagg.errors import UserError


def check_host(config: DisaggConfig, gpu_count: int | None = None,
               roles: Sequence[str] = PLACED_ROLES) -> None:
    """Refuse placements of ``roles`` this host cannot honour (GPUs that are not there,
    unknown cores)."""
    gpu_count = count_gpus() if gpu_count is None else gpu_count
    if config.device == "cuda" and not gpu_count:
        raise UserError(f"{config.source}: model.device: cuda, but this host has no NVIDIA GPU; "
                        f"use model.device: cpu (or leave it out) on a CPU host")
    usable = os.sched_getaffinity(0)
    for role in roles:
        server = config.server(role)
        missing = _missing_gpu(server.gpus, gpu_count)
        if missing:
            raise UserError(f"{config.source}: {role}_server.gpus: {list(server.gpus)} asks for "
                            f"{missing}; use `cpus: [0]` or `instances: 1` on a CPU host")
        bad = [c for c in server.cpus if c not in usable]
        if bad:
            raise UserError(f"{config.source}: {role}_server.cpus: core {bad[0]} is not usable here "
                            f"(usable: {sorted(usable)}); pick cores from that list")


def with_gpus_flag(config: DisaggConfig, role: str, spec: str,
                   gpu_count: int | None = None) -> DisaggConfig:
    """``serve context|generation --gpus 0,1``: the role's instances go one per GPU in
    ``spec``, replacing its ``gpus``, ``cpus`` and ``instances``. GPUs this host lacks are
    one error line naming the flag (:func:`check_host` names the key for a config's own)."""
    if role not in ENGINE_ROLES:
        raise UserError(f"--gpus: serve {role} places no model on a GPU by itself; give "
                        f"context_server.gpus / generation_server.gpus in the config, or run "
                        f"serve context|generation --gpus")
    parts = [g.strip() for g in spec.split(",")]
    if not all(p.isdigit() for p in parts) or len(set(map(int, parts))) != len(parts):
        raise UserError(f"--gpus: {spec!r} must list distinct GPU indices, e.g. --gpus 0,1")
    gpus = [int(p) for p in parts]
    missing = _missing_gpu(gpus, count_gpus() if gpu_count is None else gpu_count)
    if missing:
        raise UserError(f"--gpus {spec}: asks for {missing}; drop --gpus on a CPU host (the "
                        f"config's cpus:/instances: place the role there)")
    placed = replace(config.server(role), gpus=tuple(gpus), cpus=(), instances=len(gpus))
    if role == Role.CONTEXT:
        return replace(config, context=placed)
    return replace(config, generation=placed)


def front_cpus(config: DisaggConfig, role: str, usable: Collection[int]) -> tuple[int, ...]:
    """The cores of the front end that ``serve role`` starts (tritonserver's own threads,
    hence the preprocessing and orchestrator stubs it forks); () means not pinned.

    ``scheduler_server.cpus`` when given (``serve all`` and ``serve scheduler``). Else, for
    ``serve all`` with ``generation_server.cpus``: the ``usable`` cores minus generation's,
    when that leaves any. The decode loop's per-step time is the token rate, while the
    front end's work per token is bursty: it belongs beside the prefill, not on the decode
    cores (on two cores it took about a third of generation's). ``serve context`` and
    ``serve generation`` run no front end: their tritonserver is not pinned (their stubs
    pin themselves, :mod:`triton_disagg.triton.placement`).
    """
    if role not in (Role.ALL, Role.SCHEDULER):
        return ()
    if config.scheduler.cpus or role == Role.SCHEDULER:
        return config.scheduler.cpus
    beside_decode = set(usable) - set(config.generation.cpus)
    return tuple(sorted(beside_decode)) if config.generation.cpus and beside_decode else ()


def count_gpus() -> int:
    """NVIDIA GPUs visible to this process (0 on CPU hosts)."""
    gpus_dir = Path("/proc/driver/nvidia/gpus")
    found = len(list(gpus_dir.iterdir())) if gpus_dir.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and found:
        found = min(found, len([v for v in visible.split(",") if v.strip()]))
    return found


def _missing_gpu(gpus: Sequence[int], gpu_count: int) -> Optional[str]:
    """``"GPU 3 but this host has only GPUs 0-1"`` for the first of ``gpus`` beyond
    ``gpu_count``; None when all are here."""
    missing = [g for g in gpus if g >= gpu_count]
    if not missing:
        return None
    have = f"only GPUs 0-{gpu_count - 1}" if gpu_count else "no GPUs"
    return f"GPU {missing[0]} but this host has {have}"

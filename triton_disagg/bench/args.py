"""Argument parsing shared by the bench subcommands."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

from triton_disagg.errors import UserError


def add_engine_arg(parser, default_under: str = "--work-dir") -> None:
    """``--engine DIR``; without it the bench builds the demo engine (:func:`bench_engine`)."""
    parser.add_argument("--engine", type=Path, help=f"engine directory (default: the demo "
                                                    f"engine, built under {default_under})")


def bench_engine(engine: Path | None, work_dir: Path, say: Callable[[str], None]) -> Path:
    """``engine`` checked to be one, or the demo engine built (or found up to date) under
    ``work_dir``; the absolute path."""
    if engine is not None:
        if not (engine / "engine.json").is_file():
            raise UserError(f"--engine: {engine} has no engine.json; build one with "
                            f"`triton-disagg build`")
        return engine.resolve()
    from triton_disagg.builders.build import build_engine
    from triton_disagg.builders.demo import write_demo_checkpoint

    checkpoint, built = work_dir / "checkpoints" / "demo", work_dir / "engines" / "demo"
    write_demo_checkpoint(checkpoint)
    build_engine(checkpoint, built, progress=say)
    return built.resolve()


def number_list(text: str, name: str, kind: type = float, allow_zero: bool = False) -> list:
    """Comma-separated numbers of ``kind``: at least one, each > 0 (>= 0 with ``allow_zero``,
    as for CPU ids); anything else is a :class:`UserError` naming the flag."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 or (v == 0 and not allow_zero) for v in values):
        bound = "non-negative" if allow_zero else "positive"
        raise UserError(f"{name}: expected comma-separated {bound} {kind.__name__} values, "
                        f"got {text!r}")
    return values


def cpus_arg(text: Optional[str], name: str = "--cpus") -> list[int]:
    """The core ids ``--cpus`` lists (:func:`number_list`, 0 allowed); without the flag,
    every core this process may run on, ascending."""
    if text is None:
        return sorted(os.sched_getaffinity(0))
    return number_list(text, name, int, allow_zero=True)

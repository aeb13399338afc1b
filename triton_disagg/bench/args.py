"""Argument parsing shared by the bench subcommands."""

from __future__ import annotations

from triton_disagg.errors import UserError


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

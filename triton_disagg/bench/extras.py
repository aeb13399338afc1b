"""What the ``bench`` commands need beyond a serving install: the ``[bench]`` extra
(transformers, matplotlib, locust; pyproject.toml). A serving install leaves it out, so
each command that needs one of them checks for it before it starts anything."""

from __future__ import annotations

import importlib.util

from triton_disagg.errors import UserError

INSTALL = "pip install 'triton-disagg[bench]'"


def require(module: str, why: str) -> None:
    """Raise :class:`UserError` (one line naming the extra) unless ``module`` can be
    imported; ``why``: what needs it, e.g. ``"bench soak runs locust"``."""
    if importlib.util.find_spec(module) is None:
        raise UserError(f"{why}, which is not installed: {INSTALL}")

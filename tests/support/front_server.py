"""What the HTTP front's server tests share beside their fixtures (tests/server/conftest.py):
the served model's id and the server's KV blocks in use."""

from __future__ import annotations

MODEL = "engine"                 # the model id: the engine directory's name (conftest's)


def blocks_used(served) -> float:
    """The KV blocks the server's pools hold now (its gauge, published every 0.5 s)."""
    from triton_disagg.routing.scrape import scrape, total

    return total(scrape(served.metrics), "disagg_kv_blocks_used")

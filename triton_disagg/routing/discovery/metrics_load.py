"""A server's load, read from its own Prometheus metrics endpoint.

Each figure is a gauge of :mod:`triton_disagg.triton.metrics` summed over the role's
model instances:

- free KV blocks: ``disagg_kv_blocks_total - disagg_kv_blocks_used``;
- live sequences (generation): ``disagg_live_sequences``;
- queued prompt tokens (context): ``disagg_queued_prompt_tokens``.

A figure is None (unknown) until its gauge shows (a model reports them shortly after it
loads) or when the role does not report it, never a made-up 0.
"""

from __future__ import annotations

from typing import Callable

from triton_disagg.routing.scrape import Samples, scrape, total

from .record import Load

TIMEOUT_SECONDS = 0.5        # the endpoint is local; a beat must not wait on it for long
TOTAL, USED = "disagg_kv_blocks_total", "disagg_kv_blocks_used"
LIVE, QUEUED = "disagg_live_sequences", "disagg_queued_prompt_tokens"


def metrics_load(metrics_url: str, role: str) -> Callable[[], Load]:
    """A load callable for :class:`~.registration.Registration`; ``metrics_url`` is
    ``http://host:port`` of the server's metrics endpoint. It raises OSError while the
    endpoint does not answer."""

    def read() -> Load:
        samples = scrape(metrics_url, timeout=TIMEOUT_SECONDS)
        blocks, used = _gauge(samples, TOTAL, role), _gauge(samples, USED, role)
        free = None if blocks is None or used is None else blocks - used
        return Load(free_kv_blocks=free, live_sequences=_gauge(samples, LIVE, role),
                    queued_prompt_tokens=_gauge(samples, QUEUED, role))
    return read


def _gauge(samples: Samples, name: str, role: str) -> int | None:
    """``name`` summed over ``role``'s series; None when it has none."""
    if not any(("role", role) in labels for labels in samples.get(name, {})):
        return None
    return int(total(samples, name, role=role))

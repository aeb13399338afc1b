"""A server's load, read from its own Prometheus metrics endpoint.

Free KV blocks are ``disagg_kv_blocks_total - disagg_kv_blocks_used`` summed over the
role's model instances (:mod:`triton_disagg.serving.metrics`); None (unknown) until
the pool gauges show (a model reports them shortly after it loads), never a made-up 0.
Live sequences and queued prompt tokens are not on the metrics endpoint, so they stay
None.
"""

from __future__ import annotations

from typing import Callable

from triton_disagg.bench.serve_metrics import scrape, total

from .record import Load

TIMEOUT_SECONDS = 0.5        # the endpoint is local; a beat must not wait on it for long
TOTAL, USED = "disagg_kv_blocks_total", "disagg_kv_blocks_used"


def metrics_load(metrics_url: str, role: str) -> Callable[[], Load]:
    """A load callable for :class:`~.registration.Registration`; ``metrics_url`` is
    ``http://host:port`` of the server's metrics endpoint. It raises OSError while the
    endpoint does not answer."""

    def read() -> Load:
        samples = scrape(metrics_url, timeout=TIMEOUT_SECONDS)
        if not any(("role", role) in labels for labels in samples.get(TOTAL, {})):
            return Load()
        free = total(samples, TOTAL, role=role) - total(samples, USED, role=role)
        return Load(free_kv_blocks=int(free))
    return read

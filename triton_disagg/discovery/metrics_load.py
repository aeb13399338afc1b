"""A server's load, read from its own Prometheus metrics endpoint.

Free KV blocks are ``disagg_kv_blocks_total - disagg_kv_blocks_used`` summed over the
role's model instances (:mod:`triton_disagg.serving.metrics`). Live sequences and
queued prompt tokens are not on the metrics endpoint, so they stay None (unknown).
"""

from __future__ import annotations

from typing import Callable

from triton_disagg.bench.serve_metrics import scrape, total

from .record import Load

TIMEOUT_SECONDS = 0.5        # the endpoint is local; a beat must not wait on it for long


def metrics_load(metrics_url: str, role: str) -> Callable[[], Load]:
    """A load callable for :class:`~.registration.Registration`; ``metrics_url`` is
    ``http://host:port`` of the server's metrics endpoint. It raises OSError while the
    endpoint does not answer."""

    def read() -> Load:
        samples = scrape(metrics_url, timeout=TIMEOUT_SECONDS)
        free = (total(samples, "disagg_kv_blocks_total", role=role)
                - total(samples, "disagg_kv_blocks_used", role=role))
        return Load(free_kv_blocks=int(free))
    return read

"""A server's load, read from its own Prometheus metrics endpoint.

Each figure is a gauge of :mod:`triton_disagg.triton.metrics` summed over the role's
model instances (the server's load), or over one model's (a context instance's: its
``model_instance`` label names the model):

- free KV blocks: ``disagg_kv_blocks_total - disagg_kv_blocks_used``;
- live sequences (generation): ``disagg_live_sequences``;
- queued prompt tokens (context): ``disagg_queued_prompt_tokens``.

A figure is None (unknown) until its gauge shows (a model reports them shortly after it
loads) or when the role does not report it, never a made-up 0.
"""

from __future__ import annotations

from typing import Callable

from triton_disagg.routing.scrape import Samples, scrape
from triton_disagg.triton.metrics import MODEL_INSTANCE

from .record import Load, Loads

TIMEOUT_SECONDS = 0.5        # the endpoint is local; a beat must not wait on it for long
TOTAL, USED = "disagg_kv_blocks_total", "disagg_kv_blocks_used"
LIVE, QUEUED = "disagg_live_sequences", "disagg_queued_prompt_tokens"


def metrics_load(metrics_url: str, role: str, models: tuple[str, ...] = ()
                 ) -> Callable[[], Loads]:
    """A load callable for :class:`~.registration.Registration`: the server's load and
    each of ``models``' (its record's, in order), from one scrape; ``metrics_url`` is
    ``http://host:port`` of the server's metrics endpoint. It raises OSError while the
    endpoint does not answer."""

    def read() -> Loads:
        samples = scrape(metrics_url, timeout=TIMEOUT_SECONDS)
        return Loads(_load(samples, role, None),
                     tuple(_load(samples, role, model) for model in models))
    return read


def _load(samples: Samples, role: str, model: str | None) -> Load:
    """``role``'s load over the instances of ``model`` (None: of every model)."""
    blocks, used = _gauge(samples, TOTAL, role, model), _gauge(samples, USED, role, model)
    free = None if blocks is None or used is None else blocks - used
    return Load(free_kv_blocks=free, live_sequences=_gauge(samples, LIVE, role, model),
                queued_prompt_tokens=_gauge(samples, QUEUED, role, model))


def _gauge(samples: Samples, name: str, role: str, model: str | None) -> int | None:
    """``name`` summed over ``role``'s series of ``model``'s instances (Triton names them
    ``<model>_<group>_<index>``; None: every model's); None when it has none."""
    series = [v for labels, v in samples.get(name, {}).items() if ("role", role) in labels
              and (model is None or _instance_of(dict(labels).get(MODEL_INSTANCE, ""), model))]
    return int(sum(series)) if series else None


def _instance_of(instance: str, model: str) -> bool:
    """Whether Triton model instance ``instance`` is one of ``model``'s (``context_0_1``
    is ``context``'s; ``context_1_0_0`` is ``context_1``'s, not ``context``'s)."""
    group, _, index = instance.rpartition("_")
    name, _, group_index = group.rpartition("_")
    return name == model and index.isdigit() and group_index.isdigit()

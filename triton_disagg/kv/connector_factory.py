"""Which KV connector a model instance gets: the strategy's class (:func:`make_connector`)
over the engine's own pool array, or over a bounded host staging buffer when the runner
keeps its KV in device memory (:func:`connector_for`, :func:`staging_for`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Optional

from triton_disagg.kv.connector import FreeBlocks, KVConnector, PoolBuffer, strategy
from triton_disagg.kv.secret import load_key

if TYPE_CHECKING:
    from triton_disagg.config.settings import EngineSettings
    from triton_disagg.engine.llm_engine import LLMEngine
    from triton_disagg.kv.device_staging import DeviceStaging


def make_connector(name: str, pool: PoolBuffer, label: str, key: bytes, fingerprint: str,
                   lease_seconds: float, free_blocks: Optional[FreeBlocks] = None
                   ) -> KVConnector:
    """The connector of strategy ``name`` (UserError if unknown); see :class:`KVConnector`
    for the other arguments (``label`` is its ``name``)."""
    chosen = strategy(name)
    cls = getattr(importlib.import_module(chosen.module), chosen.class_name)
    return cls(pool, label, key, fingerprint, lease_seconds, free_blocks)


def connector_for(settings: "EngineSettings", engine: "LLMEngine", instance: str,
                  free_blocks: Optional[FreeBlocks] = None) -> KVConnector:
    """The connector a context (``free_blocks`` given) or generation model instance named
    ``instance`` uses over ``engine``'s pool, as its settings say: a CPU pool's own array,
    or a device pool's bounded staging buffer (:func:`staging_for`)."""
    pool = PoolBuffer(engine.pool.array)
    if engine.runtime.on_cuda:
        staging = staging_for(settings, engine, free_blocks)
        pool = PoolBuffer(staging.array, staging)
        free_blocks = staging.freeing() if free_blocks is not None else None
    return make_connector(settings.kv_strategy, pool, instance, load_key(settings.kv_key_id),
                          engine.spec.fingerprint, settings.kv_lease_seconds, free_blocks)


def staging_for(settings: "EngineSettings", engine: "LLMEngine",
                free_blocks: Optional[FreeBlocks]) -> "DeviceStaging":
    """The staging buffer of an engine whose runner computes its KV in device memory:
    ``kv_cache.max_size`` bytes of host blocks in the pool's layout and dtype (at least one
    longest sequence, at most the device pool), not a host copy of the whole pool."""
    from triton_disagg.kv.device_staging import DeviceStaging, staging_rows

    geometry = engine.pool.geometry
    rows = staging_rows(engine.pool.num_total, geometry, settings.kv_max_size,
                        geometry.blocks_for(engine.spec.max_context - 1))
    return DeviceStaging(engine.runner, geometry, rows, free_blocks)

"""Does ``kv_cache.max_size`` hold one longest sequence in each engine model's pool?

A pool smaller than one ``max_seq_len`` sequence refuses some valid requests for ever,
so it is a config mistake, reported as one :class:`UserError` line naming
``kv_cache.max_size``, the size needed and the fix. :func:`check_kv_capacity` checks a
whole config before Triton starts (cheap: it reads ``engine.json`` only);
:func:`check_pool` is the same check for one model instance, run by :func:`make_engine`
(the instance's engine, its pool sized by ``kv_cache.max_size`` and the side's
``tokens_per_block`` / ``kv_dtype``) from ``initialize``. On CUDA a ``max_size`` the
config does not write caps nothing (:func:`pool_cap`): ``kv_cache.gpu_memory_fraction``
sizes the device pool and :func:`~triton_disagg.engine.runtime.device_pool_blocks` makes
the same one-longest-sequence check.

Invariant: a pool passes exactly when it holds the KV of the longest sequence the engine
runs, ``max_context - 1`` tokens (the last generated token's KV is never written).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from triton_disagg.engine.runtime import Runtime
from triton_disagg.engine.scheduler import CapacityPolicy
from triton_disagg.engine.spec import EngineSpec, KVLayout
from triton_disagg.errors import UserError
from triton_disagg.engine.block_pool import BlockPool

if TYPE_CHECKING:
    from triton_disagg.config.disagg import DisaggConfig
    from triton_disagg.config.settings import EngineSettings
    from triton_disagg.engine.block_pool import BlockEvents
    from triton_disagg.engine.llm_engine import LLMEngine


def kv_layout(spec: EngineSpec, tokens_per_block: int | None, kv_dtype: str | None) -> KVLayout:
    """The engine's KV layout with a server's ``tokens_per_block`` / ``kv_dtype`` overrides."""
    return KVLayout(tokens_per_block or spec.kv.tokens_per_block, kv_dtype or spec.kv.dtype)


def check_pool(spec: EngineSpec, layout: KVLayout, max_size: int, role: str) -> None:
    """Raise :class:`UserError` unless ``max_size`` bytes hold one longest sequence."""
    geometry = spec.block_geometry(layout)
    have = BlockPool.blocks_for_budget(geometry, max_size)
    tokens = spec.max_context - 1
    need = geometry.blocks_for(tokens)
    if have < need:
        mib = -(-need * geometry.block_nbytes // 2**20)           # rounded up
        raise UserError(
            f"kv_cache.max_size: {max_size} bytes hold {have} KV blocks of "
            f"{layout.tokens_per_block} tokens ({have * layout.tokens_per_block} tokens, "
            f"{layout.dtype}) per {role} instance, but one max_seq_len sequence of "
            f"{spec.max_context} tokens needs {need} blocks ({tokens} tokens of KV); raise "
            f"kv_cache.max_size to at least {mib}MiB or build the engine with a smaller "
            f"--max-seq-len")


def check_kv_capacity(config: "DisaggConfig", roles: Iterable[str] | None = None) -> None:
    """Check every engine model's pool of a loaded ``DisaggConfig`` (``roles``: default
    the engine models of its mode) before Triton starts."""
    spec = EngineSpec.load(config.engine)
    if roles is None:
        roles = config.engine_roles
    if config.device == "cuda" and not config.kv_cache.max_size_given:
        return      # gpu_memory_fraction sizes the pools on the device (pool_cap)
    for role in roles:
        server = config.server(role)
        layout = kv_layout(spec, server.tokens_per_block, server.kv_dtype)
        try:
            check_pool(spec, layout, config.kv_cache.max_size, role)
        except UserError as exc:
            raise UserError(f"{config.source}: {exc}") from None


def make_engine(settings: "EngineSettings", role: str, device_index: int | None = None,
                kv_events: "BlockEvents | None" = None) -> "LLMEngine":
    """A context or generation instance's engine (``role`` names it in the capacity error),
    on the runner its settings name (what they leave out: this host's default), on CUDA
    device ``device_index`` (its Triton instance's GPU) when it runs on CUDA; its pool tells
    ``kv_events`` (a KV event publisher) what it caches."""
    from triton_disagg.engine.llm_engine import LLMEngine

    spec = EngineSpec.load(settings.engine)
    layout = kv_layout(spec, settings.tokens_per_block, settings.kv_dtype)
    runtime = Runtime.default(settings.runtime, settings.device, settings.dtype, device_index)
    max_bytes = pool_cap(settings, runtime)
    if max_bytes is not None:
        check_pool(spec, layout, max_bytes, role)
    return LLMEngine(settings.engine, kv_max_bytes=max_bytes, kv_layout=layout,
                     runtime=runtime, kv_memory_fraction=settings.kv_gpu_memory_fraction,
                     prefix_caching=settings.kv_prefix_caching, kv_events=kv_events,
                     capacity_policy=CapacityPolicy(settings.kv_capacity_policy))


def pool_cap(settings: "EngineSettings", runtime: Runtime) -> int | None:
    """The bytes that cap an instance's KV pool: ``kv_cache.max_size`` on CPU (default or
    not); on CUDA only when the config writes it, else None: the pool is then
    ``kv_cache.gpu_memory_fraction`` of the memory free after the weights, as TensorRT-LLM's
    ``free_gpu_memory_fraction`` (the 2 GB default would cap an 80-140 GB GPU's pool)."""
    if runtime.on_cuda and not settings.kv_max_size_given:
        return None
    return settings.kv_max_size

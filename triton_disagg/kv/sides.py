"""Engine construction and the KV handoff ends shared by the context and generation models.

- :func:`make_engine`: the instance's engine with its pool sized by
  ``kv_cache.max_size`` and the side's ``tokens_per_block`` / ``kv_dtype``; refused
  (one line) when that pool cannot hold one ``max_seq_len`` sequence.
- :class:`Sender` (context): turns prefilled blocks into a ``context_phase_params``
  handle signed with the deployment key (:mod:`triton_disagg.kv.secret`), which
  the receiver checks before it reads anything else. ``direct_transfer`` leases
  the blocks to a NIXL reader (freed on its notification or at lease expiry);
  ``host_memory`` copies them into a shared-memory slot and frees them at once (a
  full staging area raises :class:`StagingFullError` at once: back-pressure the
  caller retries, never a wait here). :meth:`Sender.release` gives back a signed
  handle that will not be fetched, whichever context instance on the host made it.
- :class:`Receiver` (generation): fetches a handle's KV into the first blocks of a
  sequence's reservation in its own pool, converting the layout when the sides differ.

Invariant: the pool is only touched under ``lock`` (the NIXL notification
thread frees leased blocks concurrently with prefill), and every block a
handoff allocates is freed exactly once: by the lease, by the engine when the
sequence ends, or here when the handoff fails.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from triton_disagg.config.settings import EngineSettings
from triton_disagg.kv import handle as kvhandle
from triton_disagg.kv.handle import KVHandle, TransferStats
from triton_disagg.kv.layout import BlockGeometry
from triton_disagg.kv.secret import load_key

def make_engine(settings: EngineSettings, role: str) -> Any:
    """``role``: "context" or "generation", for the capacity error."""
    from triton_disagg.engine.llm_engine import LLMEngine
    from triton_disagg.engine.spec import EngineSpec
    from triton_disagg.engine.capacity import check_pool, kv_layout

    spec = EngineSpec.load(settings.engine)
    layout = kv_layout(spec, settings.tokens_per_block, settings.kv_dtype)
    check_pool(spec, layout, settings.kv_max_size, role)
    return LLMEngine(settings.engine, kv_max_bytes=settings.kv_max_size, kv_layout=layout)


class Sender:
    def __init__(self, engine: Any, settings: EngineSettings, instance: str, lock: threading.Lock):
        self.engine, self.lock = engine, lock
        self.strategy, self.ttl = settings.kv_strategy, settings.kv_lease_seconds
        self.fingerprint, self.key = engine.spec.fingerprint, load_key(settings.kv_key_id)
        pool = engine.pool
        if self.strategy == "direct_transfer":
            from triton_disagg.kv.nixl import NixlEndpoint

            self.endpoint = NixlEndpoint(f"context-{instance}", pool.array, self.free)
        else:
            from triton_disagg.kv.host_memory import HostStaging

            from triton_disagg.kv.host_memory import StagingReader

            # One slot per block of the context pool: staging holds whatever the pool can.
            self.staging = HostStaging.create(instance, pool.num_total, pool.geometry.block_nbytes)
            self.peers = StagingReader()

    def free(self, block_ids: Sequence[int]) -> None:
        with self.lock:
            self.engine.pool.free(block_ids)

    def hand_off(self, block_ids: Sequence[int], num_tokens: int) -> bytes:
        """Handle bytes for ``block_ids``; ownership of the blocks passes to the handoff."""
        if self.strategy == "direct_transfer":
            try:
                handle = self.endpoint.export(block_ids, num_tokens, self.fingerprint, self.ttl)
            except ValueError:        # refused before the lease took the blocks
                self.free(block_ids)
                raise
            try:
                return kvhandle.encode(handle, self.key)
            except kvhandle.HandleError:  # too large to hand out: give the blocks back now
                self.endpoint.leases.release(handle.lease_id)
                raise
        try:
            with self.lock:
                handle = self.staging.put(self.engine.pool.array, block_ids, num_tokens,
                                          self.fingerprint, self.ttl)
        finally:
            self.free(block_ids)
        return kvhandle.encode(handle, self.key)  # too large: its slots expire with the lease

    def release(self, data: bytes) -> None:
        """Give back the KV of handle bytes ``data`` (checked against the deployment key)."""
        handle = _same_strategy(kvhandle.decode(data, self.key), self.strategy, "context")
        if self.strategy == "direct_transfer":
            self.endpoint.release(handle)
        elif handle.shm_name == self.staging.name:
            self.staging.discard(handle)
        else:
            self.peers.discard(handle)     # another instance's area on this host

    def expired_total(self) -> int:
        if self.strategy == "direct_transfer":
            return self.endpoint.leases.expired_total
        self.staging.reap()
        return self.staging.expired_total

    def close(self) -> None:
        if self.strategy == "direct_transfer":
            self.endpoint.close()
        else:
            self.peers.close()
            self.staging.close()


class Receiver:
    def __init__(self, engine: Any, settings: EngineSettings, instance: str):
        self.engine, self.strategy = engine, settings.kv_strategy
        self.geometry: BlockGeometry = engine.pool.geometry
        self.key = load_key(settings.kv_key_id)
        if self.strategy == "direct_transfer":
            from triton_disagg.kv.nixl import NixlEndpoint

            self.endpoint = NixlEndpoint(f"generation-{instance}", engine.pool.array)
        else:
            from triton_disagg.kv.host_memory import StagingReader

            self.reader = StagingReader()

    def decode(self, data: bytes) -> KVHandle:
        handle = kvhandle.decode(data, self.key)
        kvhandle.check_handle(handle, self.engine.spec.fingerprint, self.geometry)
        return _same_strategy(handle, self.strategy, "generation")

    def fetch(self, handle: KVHandle, reserved: Sequence[int]) -> TransferStats:
        """Fill the first ``blocks_for(handle.num_tokens)`` of ``reserved`` (a sequence's
        blocks in position order, owned by the caller) with the handle's KV."""
        blocks = list(reserved[:self.geometry.blocks_for(handle.num_tokens)])
        if self.strategy == "direct_transfer":
            return self.endpoint.fetch(handle, blocks)
        return self.reader.fetch(handle, self.engine.pool.array, blocks)

    def close(self) -> None:
        (self.endpoint if self.strategy == "direct_transfer" else self.reader).close()


def _same_strategy(handle: KVHandle, strategy: str, role: str) -> KVHandle:
    """``handle``, when it was made for ``strategy``; else HandleError."""
    if handle.strategy != strategy:
        raise kvhandle.HandleError(
            f"context_phase_params uses {handle.strategy} but this {role} model is set up for "
            f"{strategy}; give both servers the same kv_cache.strategy")
    return handle

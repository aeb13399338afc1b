"""``strategy: direct_transfer`` behind the KV connector interface: the receiver READs KV
blocks from the sender's pool with NIXL.

:class:`NixlConnector` makes one :class:`~triton_disagg.kv.nixl_endpoint.NixlEndpoint` per
instance, named ``<label>-<pid>-<random>`` (that module states the protocol: leases,
ticket words, single-use handles, and why a fetch never returns another request's KV); its
fetches run on the connector's fetch thread. With ``--overlap_kv_transfer`` it also listens
for and announces layer-by-layer transfers (:mod:`triton_disagg.kv.overlap`,
:mod:`triton_disagg.kv.layer_reader`).

Invariants: those of :class:`~triton_disagg.kv.connector.KVConnector`; an export that
NIXL refuses gives its blocks back before raising, one it accepts belongs to the lease
table from then on.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from triton_disagg.kv import handle as kvhandle
from triton_disagg.kv.connector import KVConnector, PoolBuffer, Transfer
from triton_disagg.kv.handle import KVHandle, TransferStats
from triton_disagg.kv.layer_reader import LayerReader
from triton_disagg.kv.nixl_endpoint import NixlEndpoint, TransferError
from triton_disagg.kv.overlap import Announcer
from triton_disagg.kv.overlap_wire import decode_listener

__all__ = ["NixlConnector"]


class NixlConnector(KVConnector):
    """``direct_transfer`` behind the connector interface: exports lease the blocks to a
    NIXL reader; a fetch READs them (see the module docstring)."""

    strategy = "direct_transfer"

    def __init__(self, pool: PoolBuffer, name: str, key: bytes, fingerprint: str,
                 lease_seconds: float, free_blocks=None):
        super().__init__(pool, name, key, fingerprint, lease_seconds, free_blocks)
        self.endpoint = NixlEndpoint(name, pool.array, free_blocks)
        self._layers: Optional[LayerReader] = None

    def listen(self, num_tokens: int) -> tuple[str, bytes]:
        if self._layers is None:
            staging = self.pool.staging
            self._layers = LayerReader(self.endpoint, self.key, self.decode, self.lease_seconds,
                                       staging.to_device if staging is not None else None)
        return self._layers.listen(num_tokens)

    def renew(self, data: bytes, prefilling: bool = True) -> None:
        handle = self._ours(kvhandle.decode(data, self.key), "context")
        self.endpoint.renew(handle.lease_id, self.lease_seconds, prefilling)

    def start_pull(self, nonce: str, block_ids: Sequence[int],
                   cached_blocks: int = 0) -> Transfer:
        return self.staged_pull(block_ids[cached_blocks:],
                                lambda rows: self._layers.start(nonce, rows, cached_blocks))

    def announcer(self, listener: bytes) -> Announcer:
        return Announcer(self.endpoint, decode_listener(listener, self.key))

    def _export(self, block_ids: list[int], num_tokens: int, prefilling: bool) -> KVHandle:
        try:
            return self.endpoint.export(block_ids, num_tokens, self.fingerprint,
                                        self.lease_seconds, filling=prefilling)
        except (ValueError, TransferError):        # refused before the lease took the blocks
            self.free_blocks(block_ids)
            raise

    def _release(self, handle: KVHandle) -> None:
        self.endpoint.release(handle)

    def expired_total(self) -> int:
        return self.endpoint.leases.expired_total

    def _fetch(self, handle: KVHandle, block_ids: list[int], deadline: float) -> TransferStats:
        return self.endpoint.fetch(handle, block_ids, deadline - time.monotonic())

    def _close(self) -> None:
        if self._layers is not None:
            self._layers.close()
        self.endpoint.close()

"""The context's side of an overlapped KV handoff (``--overlap_kv_transfer``): a request
whose generation already waits (it carries generation's ``kv_listener``) has its reserved
blocks leased before the prefill writes them, and generation hears of the handle, of each
layer as the prefill finishes it (after a device KV's layers are copied to the host array),
and of the first token, through a :class:`~triton_disagg.kv.overlap.Announcer`.

Called by the context loop's prefill pass (:class:`~triton_disagg.context.prefill_loop.
Prefiller`), on the loop's thread alone. Invariants: an overlapped request that fails
(a bad listener, an export or a copy that fails, the prefill failing, a first token that
finishes the request) fails alone and gives its KV back (the lease, if taken, is released)
and generation is told why; generation that cannot be reached leaves an ordinary handoff.
:func:`handoff_error` is how any KV handoff's failure becomes the request's error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from triton_disagg import protocol as P
from triton_disagg.engine.block_pool import BlockPool
from triton_disagg.engine.llm_engine import PrefillResult
from triton_disagg.engine.sequence import Sequence
from triton_disagg.errors import EngineError, RequestError, Unavailable
from triton_disagg.kv.connector import ConnectorError, HandoffBusy, KVConnector
from triton_disagg.kv.handle import HandleError
from triton_disagg.triton import tensors

if TYPE_CHECKING:
    from triton_disagg.kv.overlap import Announcer

_log = logging.getLogger(__name__)


@dataclass
class OverlappedHandoff:
    """One overlapped request through the prefill: its announcer, the handle that leased its
    blocks, and its error (it then fails alone; its KV goes back with the lease).

    Generation that cannot be reached (its agent refuses the connection or a notification)
    is not this request's mistake: the announcer is dropped and the request goes on as an
    ordinary handoff, whose handle the orchestrator holds; a generation server that cannot
    be reached is lost, and the orchestrator moves the request to another."""

    connector: KVConnector
    pool: BlockPool          # the context's, whose reserved blocks the handoff leases
    request_id: str
    blocks: list[int]
    announcer: Announcer | None = None
    handle: bytes = b""
    error: Exception | None = None
    result: PrefillResult | None = None    # the prefill's, once it landed
    staged: int = 0          # layers of a device KV copied to the host array so far

    @classmethod
    def begin(cls, connector: KVConnector, pool: BlockPool, seq: Sequence,
              listener: bytes) -> "OverlappedHandoff":
        """Lease ``seq``'s reserved blocks (not yet written) and send generation the handle."""
        overlapped = cls(connector, pool, seq.request_id, list(seq.block_table.block_ids))
        return overlapped.announce(listener, len(seq.prompt_ids))

    def announce(self, listener: bytes, prompt_length: int) -> "OverlappedHandoff":
        """Reach generation's ``listener``, lease the blocks and send it their handle; a bad
        listener or a failed export fails this request alone (unreachable generation: an
        ordinary handoff, see the class docstring)."""
        try:
            self.announcer = self.connector.announcer(listener)
        except ConnectorError as exc:
            self._unheard(exc)
        except Exception as exc:  # noqa: BLE001 - a bad listener fails this request alone
            self.pool.free(self.blocks)
            self.error = RequestError(f"kv_listener: {exc}")
            return self
        try:
            self.handle = self.connector.export(self.blocks, prompt_length,
                                                          prefilling=True)
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            self.fail(handoff_error(exc))
        else:
            self._tell(lambda a: a.handle(self.handle))
        return self

    def layers(self, done: int) -> None:
        """Layers ``0..done-1`` are final: copy a device KV's new ones to the host array,
        restart the lease (a long prefill must not outlast it while it still makes
        progress) and tell generation."""
        if self.error is None:
            try:
                self._stage(done)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                self.fail(handoff_error(exc))
                return
            self.connector.renew(self.handle)
            self._tell(lambda a: a.layers(done))

    def _stage(self, done: int) -> None:
        self.connector.stage(self.blocks, range(self.staged, done))
        self.staged = done

    def landed(self, result: PrefillResult) -> "OverlappedHandoff | Exception":
        """The prefill ended: the first token goes to generation (every layer is in place),
        or, if it finished the request, the KV goes back and generation is told so."""
        self.result = result
        if self.error is None and result.finish_reason is not None:
            self.fail(None, f"the request finished at its first token ({result.finish_reason})")
        elif self.error is None:
            try:
                self._stage(self.connector.geometry.num_layers)
                # final: the lease runs from now
                self.connector.renew(self.handle, prefilling=False)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                self.fail(handoff_error(exc))
            else:
                self._tell(lambda a: a.first(result.token_id, result.logprob))
        return self.error if self.error is not None else self

    def outputs(self) -> dict:
        """The context's answer (after :meth:`landed`): the first token and the handle."""
        r = self.result
        assert r is not None, "outputs() follows landed()"
        out = tensors.prefill_outputs(r)
        handle = self.handle if r.finish_reason is None else b""
        out[P.CONTEXT_PHASE_PARAMS] = np.frombuffer(handle, dtype=np.uint8)
        return out

    def _tell(self, say: Callable[[Announcer], None]) -> None:
        """``say(announcer)``, unless generation was found unreachable before."""
        if self.announcer is not None:
            try:
                say(self.announcer)
            except ConnectorError as exc:
                self._unheard(exc)

    def _unheard(self, exc: Exception) -> None:
        _log.warning("generation cannot be reached for the overlapped KV handoff (%s); the "
                     "request goes on as an ordinary handoff", exc,
                     extra={"request_id": self.request_id})
        self.announcer = None

    def fail(self, error: Exception | None, reason: str = "") -> None:
        """Give the KV back (the lease, if it was taken) and tell generation why."""
        self.error = error
        if self.handle:
            self.connector.release(self.handle)
        if self.announcer is not None:
            self.announcer.failed(reason or str(error))


def handoff_error(exc: Exception) -> Exception:
    """A KV handoff that failed, as the request's error: a handle too large for its prompt
    is the request's (INVALID_ARG); no room now is UNAVAILABLE; anything else (a transport
    or a device copy that failed) is a fault of the server (INTERNAL), not the client's."""
    if isinstance(exc, HandleError):
        return RequestError(f"KV handoff failed: {exc}")
    if isinstance(exc, HandoffBusy):
        return Unavailable(f"KV handoff failed: {exc}")
    _log.error("KV handoff failed", exc_info=exc)
    return EngineError(f"KV handoff failed: {type(exc).__name__}: {exc}")

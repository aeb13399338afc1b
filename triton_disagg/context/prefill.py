"""The context model's logic: prefill a batch of waiting prompts, hand each one's KV off.

Triton's dynamic batcher gives one ``execute`` every prompt that waited; they
are prefilled in one engine pass (:meth:`LLMEngine.prefill_only`). Each result
is the first token plus ``context_phase_params`` (empty when the first token
already finished the request: its blocks are freed, nothing is handed off).

Invariants: one request's mistake fails only that request (the batch is
retried one by one); ``execute`` never waits for memory: a request whose KV
blocks or staging slots are not free now gets an error starting with
``protocol.CONTEXT_BUSY`` at once (back-pressure: the orchestrator retries it),
so the instance goes on serving prompts that fit; every result either carries a
handle that owns its blocks or has no blocks (the KV connector,
:mod:`triton_disagg.kv.connector`, frees them exactly once); the pool is only touched
under ``lock``, since a connector frees handed-off blocks from its own thread;
:attr:`ContextSide.queued_tokens` counts the prompt tokens of the batches inside
:meth:`ContextSide.prefill` (0 when none is), which the reporter publishes as
``disagg_queued_prompt_tokens`` with the pool gauges.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from triton_disagg import protocol as P
from triton_disagg.config.settings import ContextSettings
from triton_disagg.engine.block_pool import KVCacheFullError
from triton_disagg.errors import RequestError
from triton_disagg.kv.connector import ConnectorError, HandoffBusy, connector_for
from triton_disagg.kv.handle import HandleError
from triton_disagg.triton import engine_request
from triton_disagg.triton.engine_request import EngineRequest

_log = logging.getLogger(__name__)

REPORT_SECONDS = 0.5


class ContextSide:
    def __init__(self, engine: Any, settings: ContextSettings, instance: str,
                 metrics: Any = None):
        self.engine, self.metrics = engine, metrics
        self.lock = threading.Lock()
        self.connector = connector_for(settings, engine, instance, self.free)
        self.queued_tokens = 0
        self._queued_lock = threading.Lock()
        self.closed = threading.Event()
        self.reporter = threading.Thread(target=self._report_loop, name="context-metrics",
                                         daemon=True)
        self.reporter.start()

    def prefill(self, batch: list[tuple[str, EngineRequest]]) -> list[dict | Exception]:
        """Engine outputs plus ``context_phase_params`` per request, or that request's error."""
        tokens = sum(len(request.prompt_ids) for _, request in batch)
        self._count_queued(tokens)
        try:
            return self._prefill_and_hand_off(batch)
        finally:
            self._count_queued(-tokens)

    def _prefill_and_hand_off(self, batch: list[tuple[str, EngineRequest]]) -> list:
        try:
            results: list = self._prefill(batch)
        except (RequestError, KVCacheFullError) as exc:
            results = [self._one(item) for item in batch] if len(batch) > 1 else [_refusal(exc)]
        answers = [self._hand_off(r) if not isinstance(r, Exception) else r for r in results]
        for (request_id, request), answer in zip(batch, answers):   # one line per request
            _log.info("prefill of %d prompt tokens: %s", len(request.prompt_ids),
                      answer if isinstance(answer, Exception) else "handed off",
                      extra={"request_id": request_id})
        return answers

    def _count_queued(self, tokens: int) -> None:
        with self._queued_lock:
            self.queued_tokens += tokens

    def free(self, block_ids: list[int]) -> None:
        """Return blocks to the pool (the connector's ``free_blocks``; any thread)."""
        with self.lock:
            self.engine.pool.free(block_ids)

    def release(self, handle: bytes) -> None:
        """Give back the KV of a handle that will not be fetched (RequestError if invalid)."""
        try:
            self.connector.release(handle)
        except (HandleError, ConnectorError) as exc:
            raise RequestError(f"{P.CONTEXT_PHASE_PARAMS}: cannot release: {exc}") from None

    def _one(self, item: tuple[str, EngineRequest]) -> Any:
        try:
            return self._prefill([item])[0]
        except (RequestError, KVCacheFullError) as exc:
            return _refusal(exc)

    def _prefill(self, batch: list[tuple[str, EngineRequest]]) -> list:
        with self.lock:
            return self.engine.prefill_only(
                [(rid, req.prompt_ids, req.params) for rid, req in batch])

    def _hand_off(self, result: Any) -> dict | Exception:
        out = engine_request.outputs([result.token_id], [result.logprob], result.logprob or 0.0,
                                     result.finish_reason)
        handle = b""
        if result.block_ids:
            try:
                handle = self.connector.export(result.block_ids, result.num_tokens)
            except HandoffBusy as exc:
                return RequestError(f"{P.CONTEXT_BUSY}: {exc}")
            except Exception as exc:  # noqa: BLE001 - e.g. a handle too large: this request fails
                return RequestError(f"KV handoff failed: {exc}")
        out[P.CONTEXT_PHASE_PARAMS] = np.frombuffer(handle, dtype=np.uint8)
        return out

    def _report_loop(self) -> None:
        """Load gauges and expired leases, also while idle (leases end on other threads). The
        queue is read before the engine lock, which a prefill holds."""
        while not self.closed.wait(REPORT_SECONDS):
            expired = self.connector.expired_total()
            if self.metrics is not None:
                self.metrics.queued_prompt_tokens(self.queued_tokens)
                with self.lock:
                    used, total = self.engine.pool.num_used, self.engine.pool.num_total
                self.metrics.kv_pool(used, total)
                self.metrics.leases_expired(expired)

    def close(self) -> None:
        self.closed.set()
        self.reporter.join()
        self.connector.close()


def _refusal(exc: Exception) -> RequestError:
    """A request's error: KV full is back-pressure (:data:`protocol.CONTEXT_BUSY`)."""
    if isinstance(exc, KVCacheFullError):
        return RequestError(f"{P.CONTEXT_BUSY}: KV cache full ({exc}); retry later or raise "
                            f"kv_cache.max_size")
    return RequestError(str(exc))

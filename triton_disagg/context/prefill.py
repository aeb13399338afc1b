"""The context model's logic: prefill a batch of waiting prompts, hand each one's KV off.

Triton's dynamic batcher gives one ``execute`` every prompt that waited; they
are prefilled in one engine pass (:meth:`LLMEngine.reserve_prompts` takes their blocks,
:meth:`LLMEngine.prefill_reserved` fills them). Each result
is the first token plus ``context_phase_params`` (empty when the first token
already finished the request: its blocks are freed, nothing is handed off).

Invariants: one request's mistake fails only that request (the batch is
retried one by one; a request id met twice in one batch fails its later copies, which
would otherwise hand off the first one's blocks twice); a prefill that fails gives every
block it reserved back (or ends the lease that took it), and each request then gets its
own result or error (a fault: ``EngineError``, INTERNAL), never an exception out of
:meth:`ContextSide.prefill`;
``execute`` never waits for memory: a request whose KV
blocks or staging slots are not free now gets an error starting with
``protocol.CONTEXT_BUSY`` at once (back-pressure: the orchestrator retries it),
so the instance goes on serving prompts that fit; every result either carries a
handle that owns its blocks or has no blocks (the KV connector,
:mod:`triton_disagg.kv.connector`, frees them exactly once); the pool is only touched
under ``lock``, since a connector frees handed-off blocks from its own thread, and such a
free never waits for a prefill (blocks freed while one runs go back when it ends, so the
connector's thread keeps serving its transport);
:attr:`ContextSide.queued_tokens` counts the prompt tokens of the batches inside
:meth:`ContextSide.prefill` (0 when none is), which the reporter publishes as
``disagg_queued_prompt_tokens`` with the pool gauges.

An overlapped request (``--overlap_kv_transfer``: it carries generation's ``kv_listener``)
has its blocks leased before the prefill writes them, and generation hears of the handle,
of each layer as it lands, and of the first token (:class:`~triton_disagg.kv.overlap.Announcer`);
one whose announcement fails gives its KV back and fails alone.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from triton_disagg import protocol as P
from triton_disagg.config.settings import ContextSettings
from triton_disagg.engine.block_pool import KVCacheFullError
from triton_disagg.errors import EngineError, RequestError
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
        self._freed: list[list[int]] = []        # frees that came while a prefill held the pool
        self._freed_lock = threading.Lock()
        self.connector = connector_for(settings, engine, instance, self.free)
        self.queued_tokens = 0
        self._queued_lock = threading.Lock()
        self.closed = threading.Event()
        self.reporter = threading.Thread(target=self._report_loop, name="context-metrics",
                                         daemon=True)
        self.reporter.start()

    def prefill(self, batch: list[tuple[str, EngineRequest]],
                listeners: list[bytes] | None = None) -> list[dict | Exception]:
        """Engine outputs plus ``context_phase_params`` per request, or that request's error;
        ``listeners``: generation's ``kv_listener`` of each request (``b""``: not
        overlapped), in batch order. A request id already met in the batch is refused."""
        listeners = listeners or [b""] * len(batch)
        repeated, seen = [], set()
        for request_id, _ in batch:
            repeated.append(request_id in seen)
            seen.add(request_id)
        unique = [item for item, again in zip(batch, repeated) if not again]
        overlapped = {rid: listener for (rid, _), listener, again
                      in zip(batch, listeners, repeated) if listener and not again}
        tokens = sum(len(request.prompt_ids) for _, request in unique)
        self._count_queued(tokens)
        try:
            answers = iter(self._prefill_and_hand_off(unique, overlapped))
        finally:
            self._count_queued(-tokens)
        return [RequestError(f"request id {rid!r} appears more than once in one batch; "
                             f"each request needs an id of its own") if again else next(answers)
                for (rid, _), again in zip(batch, repeated)]

    def _prefill_and_hand_off(self, batch: list[tuple[str, EngineRequest]],
                              listeners: dict[str, bytes]) -> list:
        try:
            results: list = self._prefill(batch, listeners)
        except Exception as exc:  # noqa: BLE001 - the blocks went back; each request tries alone
            results = ([self._one(item, listeners) for item in batch] if len(batch) > 1
                       else [_refusal(exc)])
        answers = [self._hand_off(r) if not isinstance(r, Exception) else r for r in results]
        for (request_id, request), answer in zip(batch, answers):   # one line per request
            done = "handed off" + (" (overlapped)" if request_id in listeners else "")
            _log.info("prefill of %d prompt tokens: %s", len(request.prompt_ids),
                      answer if isinstance(answer, Exception) else done,
                      extra={"request_id": request_id})
        return answers

    def _count_queued(self, tokens: int) -> None:
        with self._queued_lock:
            self.queued_tokens += tokens

    def free(self, block_ids: list[int]) -> None:
        """Return blocks to the pool (the connector's ``free_blocks``; any thread); while a
        prefill holds the pool they queue, and go back as soon as the pool is free."""
        with self._freed_lock:
            self._freed.append(list(block_ids))
        if self.lock.acquire(blocking=False):
            try:
                self._give_back_freed()
            finally:
                self.lock.release()

    def _give_back_freed(self) -> None:
        """Return the queued frees to the pool (holding ``lock``)."""
        with self._freed_lock:
            freed, self._freed = self._freed, []
        for block_ids in freed:
            self.engine.pool.free(block_ids)

    @contextmanager
    def _pool(self) -> Iterator[Any]:
        """The pool, held (frees queued meanwhile go back first and last)."""
        with self.lock:
            self._give_back_freed()
            try:
                yield self.engine.pool
            finally:
                self._give_back_freed()

    def release(self, handle: bytes) -> None:
        """Give back the KV of a handle that will not be fetched (RequestError if invalid)."""
        try:
            self.connector.release(handle)
        except (HandleError, ConnectorError) as exc:
            raise RequestError(f"{P.CONTEXT_PHASE_PARAMS}: cannot release: {exc}") from None

    def _one(self, item: tuple[str, EngineRequest], listeners: dict[str, bytes]) -> Any:
        try:
            return self._prefill([item], listeners)[0]
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            return _refusal(exc)

    def _prefill(self, batch: list[tuple[str, EngineRequest]],
                 listeners: dict[str, bytes]) -> list:
        """Each request's PrefillResult (an overlapped one's as an _Overlapped), or error."""
        with self._pool():
            seqs = self.engine.reserve_prompts(
                [(rid, req.prompt_ids, req.params) for rid, req in batch])
        overlapped: dict[str, _Overlapped] = {}
        try:
            for s in seqs:
                if listeners.get(s.request_id):
                    overlapped[s.request_id] = _Overlapped.begin(self, s,
                                                                 listeners[s.request_id])
            failed = {rid: o.error for rid, o in overlapped.items() if o.error is not None}
            kept = [s for s in seqs if s.request_id not in failed]
            live = [o for o in overlapped.values() if o.error is None]

            def on_layer(li: int) -> None:
                for o in live:
                    o.layers(li + 1)

            with self._pool():
                results = self.engine.prefill_reserved(kept, on_layer if live else None,
                                                       frozenset(overlapped))
        except BaseException as exc:
            self._give_back(seqs, overlapped, exc)
            raise
        done = {r.request_id: (overlapped[r.request_id].landed(r)
                               if r.request_id in overlapped else r) for r in results}
        return [failed.get(rid) or done[rid] for rid, _ in batch]

    def _give_back(self, seqs: list[Any], overlapped: dict[str, "_Overlapped"],
                   exc: BaseException) -> None:
        """A prefill failed: free the blocks of ``seqs`` that no handoff owns, and end the
        leases of the overlapped ones that took theirs (those that failed earlier gave
        theirs back then)."""
        with self._pool():
            for seq in seqs:
                if seq.request_id not in overlapped:
                    seq.block_table.release(self.engine.pool)
        for o in overlapped.values():
            if o.error is None:
                try:
                    o._fail(RequestError(f"the prefill failed: {type(exc).__name__}: {exc}"))
                except Exception:  # noqa: BLE001 - the other leases still end
                    _log.exception("giving back the KV of %s failed", o.request_id)

    def _hand_off(self, result: Any) -> dict | Exception:
        if isinstance(result, _Overlapped):
            return result.outputs()
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
                with self._pool() as pool:
                    stats = pool.stats()
                self.metrics.kv_pool(stats)
                self.metrics.leases_expired(expired)

    def close(self) -> None:
        self.closed.set()
        self.reporter.join()
        self.connector.close()


def _refusal(exc: Exception) -> RequestError | EngineError:
    """A request's error: KV full is back-pressure (:data:`protocol.CONTEXT_BUSY`), a
    request's mistake is its RequestError, anything else a fault (logged, INTERNAL)."""
    if isinstance(exc, KVCacheFullError):
        return RequestError(f"{P.CONTEXT_BUSY}: KV cache full ({exc}); retry later or raise "
                            f"kv_cache.max_size")
    if isinstance(exc, RequestError):
        return RequestError(str(exc))
    _log.error("prefill failed", exc_info=exc)
    return EngineError(f"prefill failed: {type(exc).__name__}: {exc}")


@dataclass
class _Overlapped:
    """One overlapped request through the prefill: its announcer, the handle that leased its
    blocks, and its error (it then fails alone; its KV goes back with the lease).

    Generation that cannot be reached (its agent refuses the connection or a notification)
    is not this request's mistake: the announcer is dropped and the request goes on as an
    ordinary handoff, whose handle the orchestrator holds; a generation server that cannot
    be reached is lost, and the orchestrator moves the request to another."""

    side: ContextSide
    request_id: str
    blocks: list[int]
    announcer: Any = None
    handle: bytes = b""
    error: Exception | None = None
    result: Any = None
    staged: int = 0          # layers of a device KV copied to the host array so far

    @classmethod
    def begin(cls, side: ContextSide, seq: Any, listener: bytes) -> "_Overlapped":
        """Lease ``seq``'s reserved blocks (not yet written) and send generation the handle."""
        blocks = list(seq.block_table.block_ids)
        o = cls(side, seq.request_id, blocks)
        try:
            o.announcer = side.connector.announcer(listener)
        except ConnectorError as exc:
            o._unheard(exc)
        except Exception as exc:  # noqa: BLE001 - a bad listener fails this request alone
            side.free(blocks)
            o.error = RequestError(f"kv_listener: {exc}")
            return o
        try:
            o.handle = side.connector.export(blocks, len(seq.prompt_ids), prefilling=True)
        except HandoffBusy as exc:
            o._fail(RequestError(f"{P.CONTEXT_BUSY}: {exc}"))
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            o._fail(RequestError(f"KV handoff failed: {exc}"))
        else:
            o._tell(lambda a: a.handle(o.handle))
        return o

    def layers(self, done: int) -> None:
        """Layers ``0..done-1`` are final: copy a device KV's new ones to the host array,
        restart the lease (a long prefill must not outlast it while it still makes
        progress) and tell generation."""
        if self.error is None:
            try:
                self._stage(done)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                self._fail(RequestError(f"KV handoff failed: {exc}"))
                return
            self.side.connector.renew(self.handle)
            self._tell(lambda a: a.layers(done))

    def _stage(self, done: int) -> None:
        self.side.connector.stage(self.blocks, range(self.staged, done))
        self.staged = done

    def landed(self, result: Any) -> "_Overlapped | Exception":
        """The prefill ended: the first token goes to generation (every layer is in place),
        or, if it finished the request, the KV goes back and generation is told so."""
        self.result = result
        if self.error is None and result.finish_reason is not None:
            self._fail(None, f"the request finished at its first token ({result.finish_reason})")
        elif self.error is None:
            try:
                self._stage(self.side.connector.geometry.num_layers)
                self.side.connector.renew(self.handle, prefilling=False)   # final: lease from now
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                self._fail(RequestError(f"KV handoff failed: {exc}"))
            else:
                self._tell(lambda a: a.first(result.token_id, result.logprob))
        return self.error if self.error is not None else self

    def outputs(self) -> dict:
        r = self.result
        out = engine_request.outputs([r.token_id], [r.logprob], r.logprob or 0.0, r.finish_reason)
        handle = self.handle if r.finish_reason is None else b""
        out[P.CONTEXT_PHASE_PARAMS] = np.frombuffer(handle, dtype=np.uint8)
        return out

    def _tell(self, say: Any) -> None:
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

    def _fail(self, error: Exception | None, reason: str = "") -> None:
        """Give the KV back (the lease, if it was taken) and tell generation why."""
        self.error = error
        if self.handle:
            self.side.connector.release(self.handle)
        if self.announcer is not None:
            self.announcer.failed(reason or str(error))

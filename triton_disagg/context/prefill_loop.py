"""The context role's engine loop and its prefill pass: one thread per model instance owns
the engine, its queue and its KV pool; a request waits in the engine's queue until its
blocks are free, is prefilled in one batched engine pass, and its KV is handed off.

``execute`` only calls :meth:`PrefillLoop.submit` (or :meth:`PrefillLoop.release`) and
returns; the loop's thread answers each request through its :class:`Answer` (Triton's
response sender). Each iteration takes what came (new requests, and the blocks the KV
connector freed from its own threads: handoffs fetched, released or expired), ends the
waiting requests whose deadline passed or whose caller cancelled, admits the queue's head
prompts whose blocks and KV handoff room are free (FIFO, up to the engine's
``max_batch_size``), prefills them (:meth:`Prefiller.prefill`: one
:meth:`LLMEngine.prefill_reserved` pass, then each one's KV exported), answers them, and
every ``REPORT_SECONDS`` publishes the gauges. An answer is the first token plus
``context_phase_params`` (empty when the first token already finished the request: its
blocks are freed, nothing is handed off). An overlapped request (``--overlap_kv_transfer``:
it carries generation's ``kv_listener``) has its blocks leased before the prefill writes
them, and generation hears of the handle, of each layer as it lands, and of the first token
(:class:`~triton_disagg.context.overlapped_handoff.OverlappedHandoff`).

Invariants:

- only the loop's thread touches the engine, the pool and the connector's exports and
  announcements; other threads reach it only through its queues (``inbox``: requests;
  ``frees``: blocks), so nothing locks the pool;
- a context without room makes a request wait, never fail or come back: the context
  receives one call per request. A request waits at most its deadline (its caller's
  timeout plus ``WAIT_GRACE_SECONDS``, so that a caller gives up first; without one
  ``DEFAULT_WAIT_SECONDS``), then gets a :class:`~triton_disagg.errors.Timeout`; one whose
  caller cancelled it is dropped (its cancel is asked at most every
  ``CANCEL_POLL_SECONDS``); an invalid one, or one whose prompt the pool could never
  hold, is answered at once;
- every submitted request gets exactly one answer: its result, its error, its timeout,
  or, at :meth:`PrefillLoop.close`, that the server is shutting down; an answer that
  cannot be delivered (its caller left) is logged, the loop goes on;
- one request's mistake or fault fails only that request, with its own error (a fault:
  ``EngineError``, INTERNAL), never an exception out of :meth:`Prefiller.prefill`: a batch
  whose prefill fails is retried one request at a time, and an overlapped request whose
  announcement fails gives its KV back and fails alone;
- a prefill that fails gives every block it took back (or ends the lease that took it);
  every answer either carries a handle that owns its blocks or holds none (the KV
  connector, :mod:`triton_disagg.kv.connector`, frees them exactly once, as messages to
  the loop);
- ``queued_tokens`` counts the prompt tokens of the requests waiting or being
  prefilled (``disagg_queued_prompt_tokens``); once nothing waits and every handoff
  ended, the next drain leaves ``pool.num_used == 0``;
- an iteration that raises is logged and the loop goes on; a loop that dies anyway takes
  the instance down (``on_death``, :func:`~triton_disagg.readers.fail_instance`).

Top-down: the loop and the types it is handed, then the prefill pass it calls.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from triton_disagg import protocol as P
from triton_disagg.config.settings import ContextSettings
from triton_disagg.engine.block_pool import PoolStats
from triton_disagg.engine.llm_engine import LLMEngine, PrefillResult
from triton_disagg.engine.sequence import EngineRequest, Sequence
from triton_disagg.errors import Cancelled, EngineError, RequestError, Timeout, Unavailable
from triton_disagg.context.overlapped_handoff import OverlappedHandoff, handoff_error
from triton_disagg.kv.connector import ConnectorError, KVConnector
from triton_disagg.kv.connector_factory import connector_for
from triton_disagg.kv.handle import HandleError
from triton_disagg.readers import OnDeath, fail_instance, guarded
from triton_disagg.triton import tensors


DEFAULT_WAIT_SECONDS = 30.0   # a request that names no timeout waits at most this long
WAIT_GRACE_SECONDS = 1.0      # beyond the caller's own timeout: the caller gives up first
REPORT_SECONDS = 0.5
DEADLINE_POLL_SECONDS = 0.1   # waiting requests' deadlines are looked at this often
CANCEL_POLL_SECONDS = 0.5     # is_cancelled() is an IPC round trip per request: at most this often
ROOM_POLL_SECONDS = 0.005     # pace while the head waits only for host staging slots
_WAKE: tuple = ()              # an inbox item that only wakes the loop (frees, close)
_log = logging.getLogger(__name__)


class Answer(Protocol):
    """Where one request's answer goes (the model's Triton response sender)."""

    def send(self, result: dict[str, np.ndarray] | Exception) -> None:
        """The request's one answer: its outputs, or its error."""

    def cancelled(self) -> bool:
        """Has the caller cancelled the request?"""


@dataclass(frozen=True)
class Prompt:
    """One context request, from ``execute`` to its answer: ``listener`` is generation's
    ``kv_listener`` (an overlapped request; else b""), ``deadline`` (time.monotonic()) when
    it stops waiting for blocks (:func:`deadline_after` its caller's timeout)."""

    request_id: str
    request: EngineRequest
    answer: Answer
    deadline: float
    listener: bytes = b""


def deadline_after(wait_seconds: float) -> float:
    """The deadline of a request whose caller waits ``wait_seconds`` (0: it named no
    timeout): ``WAIT_GRACE_SECONDS`` after the caller gives up, or ``DEFAULT_WAIT_SECONDS``
    from now."""
    return time.monotonic() + (wait_seconds + WAIT_GRACE_SECONDS if wait_seconds > 0
                               else DEFAULT_WAIT_SECONDS)


class ContextObserver(Protocol):
    """Hears a context instance's queue and pool
    (:class:`~triton_disagg.triton.metrics.Metrics`)."""

    def queued_prompt_tokens(self, tokens: int) -> None: ...

    def kv_pool(self, stats: PoolStats) -> None: ...

    def leases_expired(self, total: int) -> None: ...


class PrefillLoop:
    """The engine loop of one context model instance over ``engine`` (module docstring);
    ``metrics`` (optional) hears its queued prompt tokens, pool and expired leases."""

    def __init__(self, engine: LLMEngine, settings: ContextSettings, instance: str,
                 metrics: ContextObserver | None = None, on_death: OnDeath = fail_instance):
        self.engine, self.metrics = engine, metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.frees: queue.SimpleQueue = queue.SimpleQueue()
        self.connector = connector_for(settings, engine, instance, self.free)
        self.prefiller = Prefiller(engine, self.connector, self._reclaim)
        self.waiting: dict[str, Prompt] = {}       # in arrival order
        self.room_limited = False     # the head waits for handoff room, not for blocks
        self.admitted = False         # the last iteration admitted a batch
        self.running = True
        self.reported = self.cancels_asked = 0.0
        self.thread = threading.Thread(target=guarded("context prefill loop", self._run,
                                                       on_death),
                                       name="prefill-loop", daemon=True)
        self.thread.start()

    @property
    def queued_tokens(self) -> int:
        return sum(len(p.request.prompt_ids) for p in list(self.waiting.values()))

    def submit(self, prompts: list[Prompt]) -> None:
        """Prefill each prompt when its turn and its blocks come, then answer it (any thread).
        Prompts submitted together are queued together, so they share a prefill pass when
        their blocks are free."""
        self.inbox.put(list(prompts))

    def free(self, block_ids: list[int]) -> None:
        """Give blocks back to the pool (the connector's ``free_blocks``; any thread): they
        go back on the loop's thread."""
        self.frees.put(list(block_ids))
        self.inbox.put(_WAKE)

    def release(self, handle: bytes) -> None:
        """Give back the KV of a handle that will not be fetched (any thread; the blocks
        come back through :meth:`free`); RequestError if the handle is invalid."""
        try:
            self.connector.release(handle)
        except (HandleError, ConnectorError) as exc:
            raise RequestError(f"{P.CONTEXT_PHASE_PARAMS}: cannot release: {exc}") from None

    def close(self, timeout: float = 10.0) -> None:
        """Answer what waits (the server is shutting down), end the thread, close the
        connector (``finalize``)."""
        self.running = False
        self.inbox.put(_WAKE)
        self.thread.join(timeout)
        self.connector.close()

    def _run(self) -> None:
        while self.running:
            try:
                self._iteration()
            except Exception:  # noqa: BLE001 - logged; the loop and the other requests go on
                _log.exception("context prefill loop: an iteration failed")
                time.sleep(0.01)
        self._take(0.0)
        for request_id in list(self.waiting):
            self._drop(request_id, Unavailable("the context server is shutting down"))

    def _iteration(self) -> None:
        self._take(self._pause())
        self._reclaim()
        self._end_overdue()
        batch = self._admit()
        try:
            if time.monotonic() - self.reported >= REPORT_SECONDS:
                self.reported = time.monotonic()
                self._report()
        finally:      # admitted: it holds its blocks and is out of the queue, so it is served
            if batch:
                self._prefill(batch)

    def _pause(self) -> float:
        """How long to wait for a message: not at all after a batch (the next may fit now);
        a head that waits for host staging slots (which another process frees) looks again
        soon; waiting requests' deadlines are looked at every ``DEADLINE_POLL_SECONDS``; an
        idle loop reports."""
        if not self.waiting:
            return REPORT_SECONDS
        if self.admitted:
            return 0.0
        return ROOM_POLL_SECONDS if self.room_limited else DEADLINE_POLL_SECONDS

    def _take(self, wait: float) -> None:
        """Queue every new request, first waiting up to ``wait`` seconds for a message."""
        try:
            item = self.inbox.get(timeout=wait) if wait else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            for prompt in item:
                self._queue(prompt)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _queue(self, prompt: Prompt) -> None:
        try:
            self.engine.add_prompt(prompt.request_id, prompt.request.prompt_ids,
                                   prompt.request.params)
        except RequestError as exc:
            _send(prompt.request_id, prompt.answer, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a fault: this request fails, the others go on
            _log.exception("context: queueing request %s failed", prompt.request_id)
            _send(prompt.request_id, prompt.answer,
                  EngineError(f"queueing failed: {type(exc).__name__}: {exc}"))
            return
        self.waiting[prompt.request_id] = prompt

    def _reclaim(self) -> None:
        """Give the blocks the connector freed back to the pool."""
        while True:
            try:
                block_ids = self.frees.get_nowait()
            except queue.Empty:
                return
            try:
                self.engine.pool.free(block_ids)
            except ValueError:  # noqa: BLE001 - a double free changes nothing; say so
                _log.exception("context: freeing KV blocks %s failed", block_ids)

    def _end_overdue(self) -> None:
        """Time out the waiting requests past their deadline; drop the cancelled ones."""
        now = time.monotonic()
        ask = now - self.cancels_asked >= CANCEL_POLL_SECONDS
        if ask:
            self.cancels_asked = now
        for request_id, prompt in list(self.waiting.items()):
            if now > prompt.deadline:
                pool = self.engine.pool
                self._drop(request_id, Timeout(
                    f"context: the request waited for KV blocks past its deadline "
                    f"({pool.num_free} of {pool.num_total} blocks free; the others hold KV "
                    f"that generation has not fetched yet)"))
            elif ask and _cancelled(prompt.answer):
                self._drop(request_id, Cancelled("the caller cancelled the request while "
                                                 "it waited for the context"))

    def _drop(self, request_id: str, error: Exception) -> None:
        """End a request that still waits in the queue, with ``error``."""
        self.engine.abort(request_id)
        _send(request_id, self.waiting.pop(request_id).answer, error)

    def _admit(self) -> list[Sequence]:
        """The head prompts whose blocks and handoff room are free now (they hold them)."""
        if not self.engine.scheduler.waiting:
            self.room_limited = self.admitted = False
            return []
        room = self.connector.handoff_room()
        batch = self.engine.admit_prompts(room)
        self.admitted = bool(batch)
        head = self.engine.scheduler.waiting[0] if self.engine.scheduler.waiting else None
        need = head.block_table.blocks_needed(len(head.prompt_ids)) if head else 0
        self.room_limited = (head is not None and need <= self.engine.pool.num_free
                             and room is not None)
        return batch

    def _prefill(self, batch: list[Sequence]) -> None:
        listeners = {s.request_id: self.waiting[s.request_id].listener for s in batch
                     if self.waiting[s.request_id].listener}
        try:
            answers = self.prefiller.prefill(batch, listeners)
        except Exception as exc:  # noqa: BLE001 - never raises (its invariant); if it did,
            _log.exception("context prefill raised")       # each request still gets an answer
            answers = [EngineError(f"prefill failed: {type(exc).__name__}: {exc}")] * len(batch)
        for seq, answer in zip(batch, answers):
            _send(seq.request_id, self.waiting.pop(seq.request_id).answer, answer)

    def _report(self) -> None:
        """Load gauges and expired leases (a host staging area counts its own on the way)."""
        expired = self.connector.expired_total()
        if self.metrics is not None:
            self.metrics.queued_prompt_tokens(self.queued_tokens)
            self.metrics.kv_pool(self.engine.pool.stats())
            self.metrics.leases_expired(expired)


def _send(request_id: str, answer: Answer, result: dict | Exception) -> None:
    """Deliver one answer; a caller that left is logged, not raised."""
    try:
        answer.send(result)
    except Exception:  # noqa: BLE001 - the loop and the other requests go on
        _log.exception("context: the answer to request %s could not be sent", request_id)


def _cancelled(answer: Answer) -> bool:
    try:
        return answer.cancelled()
    except Exception:  # noqa: BLE001 - a sender that cannot say is taken as still waiting
        return False


class Prefiller:
    """``engine``'s prefill passes and ``connector``'s exports (the loop's thread alone);
    ``reclaim()`` takes back into the pool the blocks the connector freed meanwhile (the
    loop's frees queue), so that a failed batch's requests can each take theirs again."""

    def __init__(self, engine: LLMEngine, connector: KVConnector,
                 reclaim: Callable[[], None]):
        self.engine, self.connector, self.reclaim = engine, connector, reclaim

    def prefill(self, seqs: list[Sequence], listeners: dict[str, bytes]) -> list[dict | Exception]:
        """Engine outputs plus ``context_phase_params`` per admitted sequence (in order), or
        that request's error; ``listeners``: generation's ``kv_listener`` of each overlapped
        request, by request id."""
        try:
            results: list = self._prefill(seqs, listeners)
        except Exception as exc:  # noqa: BLE001 - the blocks went back; each request tries alone
            results = ([self._one(seq, listeners) for seq in seqs] if len(seqs) > 1
                       else [_refusal(exc)])
        answers = [self._hand_off(r) if not isinstance(r, Exception) else r for r in results]
        for seq, answer in zip(seqs, answers):   # one line per request
            done = "handed off" + (" (overlapped)" if seq.request_id in listeners else "")
            _log.info("prefill of %d prompt tokens: %s", len(seq.prompt_ids),
                      answer if isinstance(answer, Exception) else done,
                      extra={"request_id": seq.request_id})
        return answers

    def _one(self, seq: Sequence, listeners: dict[str, bytes]
             ) -> PrefillResult | OverlappedHandoff | Exception:
        """``seq``'s request alone, in blocks of its own again (its batch's went back)."""
        try:
            self.reclaim()
            again = self.engine.reserve_prompts([(seq.request_id, seq.prompt_ids, seq.params)])
            return self._prefill(again, listeners)[0]
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            return _refusal(exc)

    def _prefill(self, seqs: list[Sequence], listeners: dict[str, bytes]
                 ) -> list[PrefillResult | OverlappedHandoff | Exception]:
        """Each sequence's PrefillResult (an overlapped one's as an OverlappedHandoff), or
        error."""
        overlapped: dict[str, OverlappedHandoff] = {}
        try:
            for s in seqs:
                if listeners.get(s.request_id):
                    overlapped[s.request_id] = OverlappedHandoff.begin(
                        self.connector, self.engine.pool, s, listeners[s.request_id])
            failed = {rid: o.error for rid, o in overlapped.items() if o.error is not None}
            kept = [s for s in seqs if s.request_id not in failed]
            live = [o for o in overlapped.values() if o.error is None]

            def on_layer(li: int) -> None:
                for o in live:
                    o.layers(li + 1)

            results = self.engine.prefill_reserved(kept, on_layer if live else None,
                                                   frozenset(overlapped))
        except BaseException as exc:
            self._give_back(seqs, overlapped, exc)
            raise
        done = {r.request_id: (overlapped[r.request_id].landed(r)
                               if r.request_id in overlapped else r) for r in results}
        return [failed.get(s.request_id) or done[s.request_id] for s in seqs]

    def _give_back(self, seqs: list[Sequence], overlapped: dict[str, OverlappedHandoff],
                   exc: BaseException) -> None:
        """A prefill failed: free the blocks of ``seqs`` that no handoff owns, and end the
        leases of the overlapped ones that took theirs (those that failed earlier gave
        theirs back then)."""
        for seq in seqs:
            if seq.request_id not in overlapped:
                seq.block_table.release(self.engine.pool)
        for o in overlapped.values():
            if o.error is None:
                try:
                    o.fail(RequestError(f"the prefill failed: {type(exc).__name__}: {exc}"))
                except Exception:  # noqa: BLE001 - the other leases still end
                    _log.exception("giving back the KV of %s failed", o.request_id)

    def _hand_off(self, result: PrefillResult | OverlappedHandoff) -> dict | Exception:
        if isinstance(result, OverlappedHandoff):
            return result.outputs()
        out = tensors.prefill_outputs(result)
        handle = b""
        if result.block_ids:
            try:
                handle = self.connector.export(result.block_ids, result.num_tokens)
            except Exception as exc:  # noqa: BLE001 - e.g. a handle too large: this request fails
                return handoff_error(exc)
        out[P.CONTEXT_PHASE_PARAMS] = np.frombuffer(handle, dtype=np.uint8)
        return out


def _refusal(exc: Exception) -> RequestError | EngineError:
    """A request's error: its own mistake is its RequestError, anything else a fault
    (logged, INTERNAL)."""
    if isinstance(exc, RequestError):
        return RequestError(str(exc))
    _log.error("prefill failed", exc_info=exc)
    return EngineError(f"prefill failed: {type(exc).__name__}: {exc}")

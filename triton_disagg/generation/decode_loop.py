"""The generation role's background loop: continuous batching over one engine instance,
and the per-request decisions of what enters it (which phase, where the prompt's KV comes
from).

``execute`` reads a request's parameters (:func:`read_request_parameters`), asks
:class:`DecodeAdmission` whether this instance serves it and where its prompt's KV comes
from, calls :meth:`DecodeLoop.submit` and returns; one thread owns the engine. Each
iteration takes new work and stops, runs ``engine.step()`` (admission, KV fetches polled,
every running sequence of the instance in one decode batch, new prompts prefilled as they
arrive), gathers each request's token events
(:class:`~triton_disagg.engine.sequence.TokenEvent`) for its orchestrator address and, once
per step, sends every address one message with all of its events (``outbox``). Stops
arrive on the instance's control socket (``stops``). The request types:

- ``context_and_generation`` (aggregated): the engine prefills and decodes.
- ``generation_only`` (disaggregated): the request carries ``context_phase_params``
  and ``input_ids`` = the prompt plus the first token the context model produced;
  the prompt's KV is fetched into this instance's pool (:class:`FetchedKV`) and the
  sequence only decodes.
- ``context_and_generation_if_cached`` (``max_local_prefill_length``): served as
  ``context_and_generation`` when at most that many of the prompt's tokens are not in this
  instance's prefix cache, else declined at once (the orchestrator then calls the context).
- ``generation_awaiting_context`` (``--overlap_kv_transfer``): ``input_ids`` = the prompt;
  the answer carries a ``kv_listener`` for the context; once the queue gives the sequence
  its blocks, the orchestrator hears so (an event with no tokens, the request's event 0:
  only then does it call the context), and the sequence takes the KV layer by layer while
  the context prefills, then the first token with the last layer (:class:`PulledKV`,
  :mod:`triton_disagg.kv.overlap`).

Invariants:

- :func:`read_request_parameters`, :meth:`DecodeAdmission.declines` and
  :meth:`DecodeAdmission.prompt_kv` run in ``execute`` (cheap checks that only read the
  engine, a clear per-request error); the rest of admission runs on the loop thread, the
  only one that changes the engine or uses the loop's sockets;
- admission is the engine scheduler's alone (one FIFO queue,
  :mod:`triton_disagg.engine.scheduler`): :meth:`DecodeAdmission.add` only queues the
  request; the scheduler takes its blocks (its capacity policy's share) before any KV
  moves, starts the prompt's KV fetch into the first ones and frees them all if the fetch
  fails, and grows them as it decodes. A request the pool could never hold is refused
  when it arrives, and a request whose KV fetch fails fails alone. A preempted request
  goes silent until it is recomputed here (prefill of prompt + generated tokens, never
  fetched again: the handle is spent), then streams on from its next token;
- every submitted request gets exactly one final event: its last token (with
  ``finish_reason``), a cancellation (finish_reason ``cancelled``), or an error;
  after that nothing more is sent for it. When the socket to an orchestrator address
  is dropped (a failed send: what it still held is lost), every request streaming to
  that address ends as an error (aborted, its KV freed, counted), and its error event
  goes out over a fresh socket: the orchestrator hears of the loss, never a short
  stream with a normal end;
- every event carries its request's key and sequence number (:class:`StreamState`: the
  engine's events since its last event, one token each, joined when it goes out; its
  events numbered 0, 1, 2, ...);
  a stop is obeyed only with the request's key; a stop for a request the loop does not
  hold, or without its key, is dropped and counted (``dropped``);
- requests stream to at most ``outbox.max_sockets`` distinct addresses at a time; a
  request for one more is refused with an error saying so;
- an overlapped request (``generation_awaiting_context``) gets an event with no tokens
  when its pull starts (the scheduler took its blocks), before any other; so the context
  only ever holds KV that generation has blocks for, and the two queues can never wait
  on each other (a context full of KV generation cannot take yet, while generation's
  blocks wait for KV the context has no room to prefill: their orders differ);
- streaming requests get an event for their first token, then one for every
  ``stream_interval`` tokens (each token exactly once, in order), then the final
  one; non-streaming ones one event with every token when they finish (for an overlapped
  request, after its event with no tokens);
- nothing in one iteration stops the loop: a failing token hand-off fails that
  request, a failing engine step the admitted ones (those holding their blocks),
  anything else is logged; a loop stuck ``stuck_seconds`` with work live is reported by
  its watchdog, which fails the requests it holds (the loop drops them if it comes
  round); at shutdown admitted requests are cancelled, queued ones refused; a loop
  that dies anyway (an exception outside one iteration) takes the instance down
  (``on_death``, :func:`~triton_disagg.readers.fail_instance`).

Top-down: the loop and the stream state it keeps, then the admission it calls and the
prompt KV sources that admission makes.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Callable, ClassVar, Protocol

import numpy as np
import zmq

from triton_disagg import protocol as P
from triton_disagg.engine.scheduler import KVArrival
from triton_disagg.engine.sequence import EngineRequest, TokenEvent
from triton_disagg.errors import ErrorCode, RequestError, Unavailable, UserError, code_of
from triton_disagg.generation.watchdog import Watchdog
from triton_disagg.kv.connector import ConnectorError, KVConnector, Transfer
from triton_disagg.kv.handle import KVHandle
from triton_disagg.readers import (BAD_KEY, UNKNOWN_REQUEST, DroppedFrames, OnDeath,
                                   fail_instance, guarded)
from triton_disagg.token_wire import (STOP_READER, StopInbox, TokenOutbox, WireError,
                                      same_key, send_errors, split_key)

if TYPE_CHECKING:
    from triton_disagg.engine.block_pool import PoolStats
    from triton_disagg.engine.llm_engine import LLMEngine

CANCELLED = "cancelled"
REPORT_SECONDS = 0.5
FETCH_POLL_SECONDS = 0.001     # pace of an iteration that only waits for KV fetches
_WAKE = ()                     # an inbox item that only wakes the loop (close)
_log = logging.getLogger(__name__)


@dataclass
class StreamState:
    """One request's token stream to the orchestrator: where it goes and what is pending.
    Invariants: ``pending`` holds exactly the engine's events for the request since its
    last event went out (one token each, in order); ``seq`` is the number of events made
    for the request so far, so its events carry 0, 1, 2, ... and every one carries the
    request's key."""

    address: str                    # the orchestrator's token address (without the key)
    key: str                        # the request's key (token_wire)
    streaming: bool
    emitted: bool = False           # has the first token gone out
    seq: int = 0                    # events made for it so far
    pending: list[TokenEvent] = field(default_factory=list)

    def numbered(self) -> int:
        """The next event's sequence number (counted as made)."""
        self.seq += 1
        return self.seq - 1


def token_event(request_id: str, live: StreamState, reason: str | None) -> TokenEvent:
    """The events ``live`` holds as one (none: no tokens), numbered and keyed, final with
    ``reason``; ``live`` holds none after."""
    pending, live.pending = live.pending, []
    joined = TokenEvent.joined(pending) if pending else TokenEvent(request_id, [])
    return joined.sent(reason, live.numbered(), live.key)


def error_event(request_id: str, live: StreamState, message: str,
                code: ErrorCode = ErrorCode.INTERNAL) -> TokenEvent:
    """The final event of a request that failed with ``code``, saying why in ``message``."""
    return TokenEvent(request_id, [], error=message, code=code, seq=live.numbered(),
                      key=live.key)


class DecodeLoop:
    """``admission`` puts work into the engine and hears about it:
    ``admission.add(request_id, request, kv)`` (queues it in the engine; may raise to refuse it,
    e.g. when the pool could never hold it), ``admission.kv_arrived(arrival)`` (a
    request's KV fetch moved its KV: the scheduler's
    :class:`~triton_disagg.engine.scheduler.KVArrival`),
    ``admission.request_done(outcome)`` and ``admission.report(live_sequences)`` (load gauges, every
    ``REPORT_SECONDS``: the requests the loop holds, admitted or queued).

    ``outbox``: ``put(address, event)``, ``flush(keep) -> {dropped address: failed
    events}`` and ``max_sockets`` (:class:`~triton_disagg.token_wire.TokenOutbox`);
    ``stops``: ``take() -> [(request id, key)]``
    (:class:`~triton_disagg.token_wire.StopInbox`) or None. The loop closes both when it
    ends. ``on_death(reader, exc)``: called if the loop's thread ends
    by an exception.

    ``stream_interval`` > 1 trades smoothness for throughput: fewer, larger messages."""

    def __init__(self, engine: LLMEngine, outbox: TokenOutbox, admission: DecodeAdmission,
                 stream_interval: int = 1, stops: StopInbox | None = None,
                 stuck_seconds: float = 30.0,
                 on_death: OnDeath = fail_instance):
        self.engine, self.outbox, self.admission = engine, outbox, admission
        self.stream_interval = stream_interval
        self.stops = stops
        self.dropped = DroppedFrames(STOP_READER)         # stops it cannot obey
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()   # _queue's arguments, or _WAKE
        self.live: dict[str, StreamState] = {}           # every request in the engine
        self.addresses: Counter[str] = Counter()  # live requests per token address
        self.progressed = True                    # the last step made tokens
        self.abandoned: set[str] = set()          # failed by the watchdog (under ``lock``)
        self.taken: list[str] = []                # overlapped pulls this step started
        self.lock = threading.Lock()
        self.running = True
        self.reported = 0.0
        self.watchdog = Watchdog("generation decode loop", stuck_seconds,
                                 lambda: bool(self.live), self._fail_stuck)
        self.thread = threading.Thread(target=guarded("generation decode loop", self._run,
                                                       on_death),
                                       name="decode-loop", daemon=True)
        self.thread.start()

    def submit(self, request_id: str, request: EngineRequest, token_address: str,
               kv: PromptKV = None) -> None:
        """Generate for ``request``, its prompt's KV from ``kv`` (None: prefilled here), and
        send its events to the orchestrator at ``token_address`` (``<address>#<key>``,
        checked by ``read_request_parameters``)."""
        address, key = split_key(token_address)
        self.inbox.put((request_id, request, kv, StreamState(address, key, request.streaming)))

    def close(self, timeout: float = 10.0) -> None:
        """Finish: cancel what is live, end the thread (``finalize``)."""
        self.running = False
        self.inbox.put(_WAKE)
        self.thread.join(timeout)
        self.watchdog.close()

    def _run(self) -> None:
        while self.running:
            self.watchdog.beat()
            try:
                self._iteration()
            except Exception:  # noqa: BLE001 - logged; the loop and the other requests go on
                _log.exception("generation decode loop: an iteration failed")
                time.sleep(0.01)
            self._flush()
        queued = [rid for rid in self.live if not self.engine.admitted(rid)]
        for request_id in [rid for rid in self.live if rid not in queued]:
            self.engine.abort(request_id)
            self._finish(request_id, CANCELLED)
        for request_id in queued:
            self.engine.abort(request_id)
            self._refuse(request_id, self._pop(request_id), "the server is shutting down",
                         ErrorCode.UNAVAILABLE)
        self._flush()
        self.outbox.close()
        if self.stops is not None:
            self.stops.close()

    def _iteration(self) -> None:
        busy = bool(self.live) or self.engine.has_unfinished()
        self._drain(wait=REPORT_SECONDS if not busy else 0.0 if self.progressed
                    else FETCH_POLL_SECONDS)
        for request_id, key in self.stops.take() if self.stops is not None else ():
            self._stop(request_id, key)
        if busy or self.live:
            try:
                events = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - an engine failure fails its requests
                for request_id in [r for r in self.live if self.engine.admitted(r)]:
                    self._fail(request_id, f"engine step failed: {exc}")
                return
            self.progressed = bool(events)
            self._arrivals()
            self._tell_taken()
            self._drop_abandoned()
            for event in events:
                try:
                    self._on_token(event)
                except Exception as exc:  # noqa: BLE001 - that request fails, the rest go on
                    self._fail(event.request_id, f"generation failed: {exc}")
        if time.monotonic() - self.reported >= REPORT_SECONDS:
            self.reported = time.monotonic()
            self.admission.report(len(self.live))

    def _drain(self, wait: float) -> None:
        """Handle every queued item, first waiting up to ``wait`` seconds for one."""
        try:
            item = self.inbox.get(timeout=wait) if wait else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not _WAKE:
                self._queue(*item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _stop(self, request_id: str, key: str) -> None:
        live = self.live.get(request_id)
        if live is None:
            self.dropped.drop(UNKNOWN_REQUEST, f"a stop for {request_id!r}, which "
                                                     f"this instance does not hold")
            return
        if not same_key(key, live.key):
            self.dropped.drop(BAD_KEY, f"a stop for {request_id} without its key")
            return
        self.engine.abort(request_id)
        self._finish(request_id, CANCELLED)

    def _queue(self, request_id: str, request: EngineRequest, kv: PromptKV,
               live: StreamState) -> None:
        if request_id in self.live:
            self._refuse(request_id, live, f"request id {request_id!r} is already generating")
            return
        if live.address not in self.addresses and len(self.addresses) >= self.outbox.max_sockets:
            self._refuse(request_id, live, f"generation streams to at most "
                         f"{self.outbox.max_sockets} orchestrator addresses at a time and all "
                         f"are busy; request refused", ErrorCode.UNAVAILABLE)
            return
        if isinstance(kv, PulledKV):
            kv = replace(kv, taken=partial(self._taken, request_id))
        try:
            self.admission.add(request_id, request, kv)
        except Exception as exc:  # noqa: BLE001 - refused request: its error, others unaffected
            self._refuse(request_id, live, str(exc), code_of(exc))
            return
        self.live[request_id] = live
        self.addresses[live.address] += 1

    def _taken(self, request_id: str) -> None:
        """An overlapped request's pull started (inside ``engine.step``, on this thread): it
        holds its blocks; its orchestrator hears so once the step's arrivals are heard
        (:meth:`_tell_taken`)."""
        self.taken.append(request_id)

    def _tell_taken(self) -> None:
        """An event with no tokens to the orchestrator of each overlapped request whose pull
        started in this step and did not fail in it (a failed one's error went out)."""
        taken, self.taken = self.taken, []
        for request_id in taken:
            live = self.live.get(request_id)
            if live is not None:
                self.outbox.put(live.address, token_event(request_id, live, None))

    def _pop(self, request_id: str) -> StreamState | None:
        """Take ``request_id`` out of the loop's live requests (None when it is not there)."""
        live = self.live.pop(request_id, None)
        if live is not None:
            self.addresses[live.address] -= 1
            if not self.addresses[live.address]:
                del self.addresses[live.address]
        return live

    def _arrivals(self) -> None:
        """Hear how the KV fetches that ended went: the KV that moved is counted (even when
        its request then failed, e.g. its overlapped first token refused); a failed one's
        request is over."""
        for arrival in self.engine.take_kv_arrivals():
            if arrival.result is not None:
                self.admission.kv_arrived(arrival)
            if arrival.error is not None and (live := self._pop(arrival.request_id)) is not None:
                self._refuse(arrival.request_id, live, str(arrival.error),
                             code_of(arrival.error))

    def _on_token(self, event: TokenEvent) -> None:
        live = self.live.get(event.request_id)
        if live is None:
            return
        live.pending.append(event)
        if event.final:
            self._finish(event.request_id, event.finish_reason)
        elif live.streaming and (not live.emitted or len(live.pending) >= self.stream_interval):
            self.outbox.put(live.address, token_event(event.request_id, live, None))
            live.emitted = True

    def _finish(self, request_id: str, reason: P.FinishReason | None) -> None:
        live = self._pop(request_id)
        self.outbox.put(live.address, token_event(request_id, live, reason))
        self.admission.request_done(CANCELLED if reason == CANCELLED else "finished")
        _log.info("generation ended: %s", reason, extra={"request_id": request_id})

    def _refuse(self, request_id: str, live: StreamState, message: str,
                code: ErrorCode = ErrorCode.INTERNAL) -> None:
        self.outbox.put(live.address, error_event(request_id, live, message, code))
        self.admission.request_done("error")
        _log.warning("generation refused or failed: %s", message,
                     extra={"request_id": request_id})

    def _fail(self, request_id: str, message: str) -> None:
        live = self._pop(request_id)
        if live is not None:
            self.engine.abort(request_id)
            self._refuse(request_id, live, message)

    def _flush(self) -> None:
        """Send this iteration's messages. For every address whose socket was dropped, fail
        every request streaming to it, and tell the requests of the failed message that had
        ended already (an error in their final event's place), over a fresh socket (one
        more flush: only errors, so a second drop ends nothing more)."""
        dropped = self.outbox.flush(self.addresses)
        for address, failed in dropped.items():
            message = (f"generation lost the token events queued for {address} (its socket "
                       f"failed or its peer disconnected); request failed")
            for request_id in [rid for rid, live in self.live.items() if live.address == address]:
                self._fail(request_id, message)
            for event in [e for e in failed if e.final]:   # the others' requests: failed above
                self.outbox.put(address, TokenEvent(event.request_id, [], error=message,
                                                    seq=event.seq, key=event.key))
        if dropped:
            self.outbox.flush(self.addresses)

    def _fail_stuck(self) -> None:
        """Watchdog thread: tell every live request's orchestrator, over sockets of its own."""
        message = f"generation loop stuck for {self.watchdog.stuck_seconds:g} s; request failed"
        with self.lock:
            stuck = list(self.live.items())
            self.abandoned.update(request_id for request_id, _ in stuck)
        send_errors(zmq.Context.instance(),
                    [(live.address, error_event(request_id, live, message))
                     for request_id, live in stuck])

    def _drop_abandoned(self) -> None:
        with self.lock:
            abandoned, self.abandoned = self.abandoned, set()
        for request_id in abandoned:
            if self._pop(request_id) is not None:
                self.engine.abort(request_id)
                self.admission.request_done("error")


def read_request_parameters(parameters: str | None) -> tuple[str, str]:
    """A generation request's JSON parameters -> (``request_type``, ``token_address``); the
    address must carry the request's key (:func:`token_wire.with_key`)."""
    params = json.loads(parameters or "{}")
    address = params.get(P.TOKEN_ADDRESS)
    if not isinstance(address, str) or not address.startswith(("ipc://", "tcp://")):
        raise RequestError(f"generation streams tokens over ZeroMQ: request parameter "
                           f"{P.TOKEN_ADDRESS!r} must name the orchestrator's ipc:// or tcp:// "
                           f"address, got {address!r}")
    try:
        split_key(address)
    except WireError as exc:
        raise RequestError(f"request parameter {P.TOKEN_ADDRESS!r}: {exc}") from None
    return params.get(P.REQUEST_TYPE, P.CONTEXT_AND_GENERATION), address


class GenerationObserver(Protocol):
    """Hears a generation instance's transfers, requests and load
    (:class:`~triton_disagg.triton.metrics.Metrics`)."""

    def kv_transfer(self, strategy: str, nbytes: int, seconds: float,
                    in_flight_seconds: float, hidden_seconds: float) -> None: ...

    def request_done(self, outcome: str) -> None: ...

    def kv_pool(self, stats: PoolStats) -> None: ...

    def live_sequences(self, count: int) -> None: ...

    def steps_blocked_by_transfer(self, total: int) -> None: ...

    def preemptions(self, total: int) -> None: ...


class DecodeAdmission:
    """Admits generation requests into ``engine`` (module docstring); ``connector``: where
    ``generation_only`` and ``generation_awaiting_context`` requests' KV comes from; None in
    aggregated mode, which serves only what it prefills itself. ``local_prefill``
    (``generation_server.max_local_prefill_length``): a
    ``context_and_generation_if_cached`` request is served here when at most that many of
    its prompt's tokens are not in this instance's prefix cache."""

    def __init__(self, engine: LLMEngine, connector: KVConnector | None,
                 metrics: GenerationObserver | None = None, local_prefill: int = 0):
        self.engine, self.connector, self.metrics = engine, connector, metrics
        self.local_prefill = local_prefill

    def declines(self, request_type: str, request: EngineRequest) -> bool:
        """Does this instance decline ``request``: a ``context_and_generation_if_cached`` one
        with more than ``local_prefill`` prompt tokens not in its prefix cache (the
        orchestrator then calls the context)?"""
        if request_type != P.CONTEXT_AND_GENERATION_IF_CACHED:
            return False
        prompt = request.prompt_ids
        cached = self.engine.cached_prompt_tokens(prompt, request.params.cache_salt)
        return len(prompt) - cached > self.local_prefill

    def prompt_kv(self, request_type: str, request: EngineRequest,
                  inputs: dict[str, np.ndarray]) -> PromptKV:
        """Where a request this instance serves takes its prompt's KV from (``execute``):
        None for one it prefills itself; RequestError for a request type or KV it cannot
        take, Unavailable when the connector cannot listen now."""
        if request_type in (P.CONTEXT_AND_GENERATION, P.CONTEXT_AND_GENERATION_IF_CACHED):
            return None
        if request_type not in (P.GENERATION_ONLY, P.GENERATION_AWAITING_CONTEXT):
            raise RequestError(f"request_type {request_type!r}: the generation model serves "
                               f"{P.CONTEXT_AND_GENERATION!r}, "
                               f"{P.CONTEXT_AND_GENERATION_IF_CACHED!r}, {P.GENERATION_ONLY!r} "
                               f"and {P.GENERATION_AWAITING_CONTEXT!r}; send "
                               f"{P.CONTEXT_ONLY!r} to the context model")
        if self.connector is None:
            raise RequestError(f"{request_type}: this server runs in aggregated mode; send "
                               f"context_and_generation")
        if request_type == P.GENERATION_AWAITING_CONTEXT:
            return self._awaiting_context(request)
        data = inputs.get(P.CONTEXT_PHASE_PARAMS)
        if data is None or not np.size(data):
            raise RequestError("generation_only needs context_phase_params from the context "
                               "model's response")
        try:
            handle = self.connector.decode(np.asarray(data, dtype=np.uint8).tobytes())
        except UserError as exc:
            raise RequestError(str(exc)) from None
        if len(request.prompt_ids) != handle.num_tokens + 1:
            raise RequestError(f"generation_only: input_ids must be the {handle.num_tokens} "
                               f"prompt tokens of context_phase_params plus the first generated "
                               f"token, got {len(request.prompt_ids)} ids")
        return FetchedKV(self.connector, handle)

    def _awaiting_context(self, request: EngineRequest) -> PulledKV:
        """Listen for the KV of ``request``'s prompt (refused when the pool could never hold
        the request, before any listener is made)."""
        self.engine.blocks_needed(P.GENERATION_AWAITING_CONTEXT, len(request.prompt_ids),
                                  request.params)
        try:
            nonce, listener = self.connector.listen(len(request.prompt_ids))
        except UserError as exc:
            raise RequestError(str(exc)) from None
        except ConnectorError as exc:
            raise Unavailable(str(exc)) from None
        return PulledKV(self.connector, nonce, len(request.prompt_ids), listener)

    def add(self, request_id: str, request: EngineRequest, kv: PromptKV) -> None:
        """Queue ``request`` in the engine, its prompt KV from ``kv`` (decode-loop thread);
        RequestError (naming the sizes and the fix) when the pool could never hold it, or
        when it is invalid. ``input_ids`` are the prompt whose KV ``kv`` brings, or that
        prompt and the context's first token (one id more); the engine refuses a prompt of
        any other length."""
        ids, params = request.prompt_ids, request.params
        if kv is None:
            self.engine.add_request(request_id, ids, params)
        elif len(ids) == kv.num_tokens + 1:
            self.engine.add_prefilled(request_id, ids[:-1], ids[-1], params, kv)
        else:
            self.engine.add_prefilled(request_id, ids, None, params, kv)

    def kv_arrived(self, arrival: KVArrival) -> None:
        """A request's KV moved (decode-loop thread; ``arrival.result`` is set, whether or
        not the request then failed): its stats, and the instance's compute while it was in
        flight, of which the part inside ``in_flight_seconds`` was hidden (the scheduler
        sets ``compute`` on every arrival)."""
        stats, compute = arrival.result, arrival.compute
        assert stats is not None and compute is not None, "a KVArrival whose KV moved"
        if self.metrics is not None:
            self.metrics.kv_transfer(self.connector.strategy, stats.nbytes, stats.seconds,
                                     stats.in_flight_seconds,
                                     compute.hidden_seconds(stats.in_flight_seconds))

    def request_done(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.request_done(outcome)

    def report(self, live_sequences: int) -> None:
        """Load gauges: the pool, and the sequences the decode loop holds; the decode steps
        blocked by a transfer and the preemptions so far (decode-loop thread)."""
        if self.metrics is not None:
            self.metrics.kv_pool(self.engine.pool.stats())
            self.metrics.live_sequences(live_sequences)
            self.metrics.steps_blocked_by_transfer(
                self.engine.scheduler.steps_blocked_by_transfer)
            self.metrics.preemptions(self.engine.scheduler.preemptions)

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()


@dataclass(frozen=True)
class FetchedKV:
    """A ``generation_only`` request's prompt KV, as the engine fetches it
    (:class:`triton_disagg.engine.sequence.RemoteKV`); the request's ``input_ids`` are its
    prompt plus the first token the context produced."""

    connector: KVConnector
    handle: KVHandle
    listener: ClassVar[bytes] = b""      # nothing for the answer to carry

    @property
    def num_tokens(self) -> int:
        return self.handle.num_tokens

    @property
    def skips_cached(self) -> bool:
        """The fetch may leave out the prompt's blocks this instance's prefix cache holds."""
        return self.connector.can_skip(self.handle)

    def start(self, block_ids: list[int], cached_blocks: int = 0) -> Transfer:
        return self.connector.start_fetch(self.handle, block_ids, cached_blocks)


@dataclass(frozen=True)
class PulledKV:
    """A ``generation_awaiting_context`` request's prompt KV, read as the context announces
    it (the listener's ``nonce``; ``listener`` is what the answer carries to the context);
    the transfer's result brings the first token. ``taken()`` is called once the pull has
    started into the sequence's blocks (the decode loop tells the orchestrator)."""

    connector: KVConnector
    nonce: str
    num_tokens: int
    listener: bytes
    taken: Callable[[], None] = lambda: None
    skips_cached = True      # an overlapped transfer needs one KV layout on both roles

    def start(self, block_ids: list[int], cached_blocks: int = 0) -> Transfer:
        transfer = self.connector.start_pull(self.nonce, block_ids, cached_blocks)
        self.taken()
        return transfer


PromptKV = FetchedKV | PulledKV | None     # where a request's prompt KV comes from; None: here

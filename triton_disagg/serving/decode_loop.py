"""The generation model's background loop: continuous batching over one engine instance.

``execute`` only calls :meth:`DecodeLoop.submit` / :meth:`DecodeLoop.stop` and
returns; one thread owns the engine: it admits new work between steps, runs
``engine.step()`` (every live sequence of the instance in one decode batch,
new prompts prefilled as they arrive) and routes each token to its request.

Invariants:

- only the loop thread touches the engine;
- admission is FIFO and decided before any KV moves: the head of ``waiting``
  enters the engine once the blocks it will ever hold are free (one comparison
  per step), taking them all; those behind it wait. Admitted requests therefore
  never wait on each other's blocks, and a request the pool could never hold is
  refused when it arrives;
- every submitted request gets exactly one final emit (``final=True``): its
  last token (with ``finish_reason``), a cancellation (finish_reason
  ``cancelled``), or an error; after that nothing more is sent for it;
- streaming requests get an emit for their first token, then one for every
  ``stream_interval`` tokens (each token exactly once, in order), then the final
  one; non-streaming ones one emit with every token when they finish.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from triton_disagg.serving import engine_request
from triton_disagg.serving.engine_request import EngineRequest

Emit = Callable[[Any, "dict | None", bool, "str | None"], None]  # (sender, outputs, final, error)
CANCELLED = "cancelled"
CANCEL_POLL_SECONDS = 0.1
REPORT_SECONDS = 0.5


@dataclass
class Live:
    sender: Any
    streaming: bool
    is_cancelled: Callable[[], bool]
    with_log_probs: bool = True
    emitted: bool = False           # has the first token gone out
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float | None] = field(default_factory=list)
    cum_log_prob: float = 0.0
    checked: float = 0.0


@dataclass
class Waiting:
    request_id: str
    work: Any
    live: Live
    blocks: int                     # KV blocks it holds once admitted


class DecodeLoop:
    """``side`` decides how work enters the engine and hears about it:
    ``side.blocks_needed(request_id, work)`` (the KV blocks the request will hold; may
    raise to refuse it, e.g. when the pool could never hold them),
    ``side.admit(engine, request_id, work)`` (called once those blocks are free: takes
    them; may raise to refuse the request), ``side.request_done(outcome)`` and
    ``side.report()`` (pool gauges, every ``REPORT_SECONDS``).

    ``stream_interval`` > 1 trades smoothness for throughput: every emit is an IPC round
    trip through Triton and down the ensemble, which costs more CPU than a decode step
    of a small model, so grouping tokens serves more of them per core.

    ``stops`` (a :class:`~triton_disagg.serving.stop_registry.StopRegistry` shared by the
    model's instances): where a stop for a request this instance does not hold is
    posted, and where this instance finds the stops meant for its live requests.
    """

    def __init__(self, engine: Any, emit: Emit, side: Any, stream_interval: int = 1,
                 stops: Any = None):
        self.engine, self.emit, self.side = engine, emit, side
        self.stream_interval = stream_interval
        self.stops = stops
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.live: dict[str, Live] = {}
        self.waiting: deque[Waiting] = deque()    # FIFO: the head enters once its blocks free
        self.running = True
        self.reported = 0.0
        self.thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)
        self.thread.start()

    def submit(self, request_id: str, request: EngineRequest | Any, sender: Any,
               is_cancelled: Callable[[], bool] = lambda: False) -> None:
        streaming = getattr(request, "streaming", True)
        with_log_probs = getattr(request, "return_log_probs", True)
        self.inbox.put(("add", request_id, request,
                        Live(sender, streaming, is_cancelled, with_log_probs)))

    def stop(self, request_id: str) -> None:
        self.inbox.put(("stop", request_id, None, None))

    def close(self, timeout: float = 10.0) -> None:
        """Finish: cancel what is live, end the thread (``finalize``)."""
        self.running = False
        self.inbox.put(("wake", "", None, None))
        self.thread.join(timeout)

    def _run(self) -> None:
        while self.running:
            self._drain(wait=0.0 if self.live else REPORT_SECONDS)
            self._check_cancelled()
            self._admit_waiting()
            if self.live:
                try:
                    events = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - an engine failure fails its requests
                    for request_id in list(self.live):
                        self.engine.abort(request_id)
                        self._fail(request_id, f"engine step failed: {exc}")
                    continue
                for event in events:
                    self._on_token(event)
            if time.monotonic() - self.reported >= REPORT_SECONDS:
                self.reported = time.monotonic()
                self.side.report()
        for request_id in list(self.live):
            self.engine.abort(request_id)
            self._finish(request_id, CANCELLED)
        for waiting in self.waiting:
            self.emit(waiting.live.sender, None, True, "the server is shutting down")

    def _drain(self, wait: float) -> None:
        """Handle every queued item, first waiting up to ``wait`` seconds for one."""
        try:
            item = self.inbox.get(timeout=wait) if wait else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, request_id, request, live = item
            if kind == "add":
                self._queue(request_id, request, live)
            elif kind == "stop":
                self._stop(request_id)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _stop(self, request_id: str) -> None:
        if request_id in self.live:
            self.engine.abort(request_id)
            self._finish(request_id, CANCELLED)
            return
        waiting = next((w for w in self.waiting if w.request_id == request_id), None)
        if waiting is not None:
            self.waiting.remove(waiting)
            self.live[request_id] = waiting.live
            self._finish(request_id, CANCELLED)
        elif self.stops is not None:
            self.stops.post(request_id)          # another instance may hold it

    def _queue(self, request_id: str, request: Any, live: Live) -> None:
        if request_id in self.live or any(w.request_id == request_id for w in self.waiting):
            self.emit(live.sender, None, True, f"request id {request_id!r} is already generating")
            return
        try:
            blocks = self.side.blocks_needed(request_id, request)
        except Exception as exc:  # noqa: BLE001 - refused request: its error, others unaffected
            self._refuse(live, str(exc))
            return
        self.waiting.append(Waiting(request_id, request, live, blocks))

    def _admit_waiting(self) -> None:
        """Admit from the head of ``waiting`` while its blocks are free (FIFO)."""
        while self.waiting and self.waiting[0].blocks <= self.engine.pool.num_free:
            waiting = self.waiting.popleft()
            try:
                self.side.admit(self.engine, waiting.request_id, waiting.work)
            except Exception as exc:  # noqa: BLE001 - refused request: its error only
                self._refuse(waiting.live, str(exc))
                continue
            self.live[waiting.request_id] = waiting.live

    def _refuse(self, live: Live, message: str) -> None:
        self.emit(live.sender, None, True, message)
        self.side.request_done("error")

    def _check_cancelled(self) -> None:
        """Poll live and waiting requests (each at once, then every CANCEL_POLL_SECONDS),
        so a request cancelled while it waits never takes blocks."""
        now = time.monotonic()
        for request_id, live in [*self.live.items(),
                                 *((w.request_id, w.live) for w in self.waiting)]:
            if now - live.checked >= CANCEL_POLL_SECONDS:
                live.checked = now
                if live.is_cancelled() or (self.stops is not None
                                           and self.stops.take(request_id)):
                    self._stop(request_id)

    def _on_token(self, event: Any) -> None:
        live = self.live.get(event.request_id)
        if live is None:
            return
        live.tokens.append(event.token_id)
        live.log_probs.append(event.logprob)
        live.cum_log_prob += event.logprob or 0.0
        if event.finished:
            self._finish(event.request_id, event.finish_reason)
        elif live.streaming and (not live.emitted or len(live.tokens) >= self.stream_interval):
            self.emit(live.sender, self._outputs(live, None), False, None)
            live.tokens, live.log_probs = [], []
            live.emitted = True

    def _finish(self, request_id: str, reason: str | None) -> None:
        live = self.live.pop(request_id)
        reason = CANCELLED if reason == "aborted" else reason
        self.emit(live.sender, self._outputs(live, reason), True, None)
        self.side.request_done(CANCELLED if reason == CANCELLED else "finished")

    def _fail(self, request_id: str, message: str) -> None:
        self._refuse(self.live.pop(request_id), message)

    @staticmethod
    def _outputs(live: Live, reason: str | None) -> dict:
        return engine_request.outputs(live.tokens, live.log_probs, live.cum_log_prob, reason,
                                      live.with_log_probs)

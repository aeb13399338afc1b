"""The orchestrator's control flow, independent of how context and generation are reached.

One request's life (disaggregated): ``context_only`` call -> the first token
goes out at once -> ``generation_only`` call carrying ``context_phase_params``
and this instance's token address -> every later token arrives over ZeroMQ
(:mod:`token_inbox`), is detokenized here and goes out. Aggregated mode makes one
``context_and_generation`` call to generation instead, and so does a prompt of at most
``local_prefill`` tokens (``generation_server.max_local_prefill_length``; 0: none); a
longer one is first offered to generation as ``context_and_generation_if_cached``, which
serves it when at most ``local_prefill`` of its tokens are not in that instance's prefix
cache and else declines at once (one round trip), and then goes the disaggregated way.
With ``overlap`` (``--overlap_kv_transfer``) generation is called first
(``generation_awaiting_context``, the prompt alone); once generation has taken the request's
blocks (its token stream's first event, with no tokens) its answer's ``kv_listener`` goes to
the context with the prompt, generation reads the KV as the context prefills it
(:mod:`triton_disagg.kv.overlap`), and the context's first token goes out when it answers,
before any of generation's.

Invariants:

- every request ends with exactly one final ``send`` (``final=True``): a
  non-streaming request gets exactly one response (Triton's ``generate``
  demands that), a streaming one gets one per token event, or one for all the events
  that queued while its previous response was being sent (:mod:`token_inbox`);
- streamed ``text_output`` deltas concatenate to the non-streamed text, multi-byte
  characters included (:func:`~triton_disagg.front.tokenizer.text_delta`);
- nothing waits for ever: generation's answer and every token event are awaited at
  most ``generation_server.stall_seconds``, and so is the context's answer (a context
  without free KV blocks keeps the request in its queue until they are, within that
  deadline: :mod:`triton_disagg.context.prefill_loop`; it is called once per request);
  every call a route makes has that deadline (a context server that misses it is tried
  once more on another: :mod:`grpc_transport`), and while the context call is out the
  client's cancel is asked for every ``CANCEL_POLL_SECONDS``: a cancelled request stops
  waiting then (the KV of an answer that comes later goes back with its lease);
- the context's KV of a request that generation never took (the client left after the
  first token, generation refused or failed the request) is given back at once with a
  ``release_kv`` call instead of waiting for its lease to expire; at most
  ``MAX_RELEASES`` such calls are out at once (each with a short deadline), beyond that
  the lease reclaims the KV;
- leaving a request before generation ended it (client cancel, a stall, a failing
  send, an error, task cancellation) stops generation (:class:`token_inbox.TokenStream`);
  the client's cancel is asked for at most every ``CANCEL_POLL_SECONDS`` while tokens
  stream;
- a generation server that is lost (it did not answer the request, or its stream went
  silent and it no longer answers a liveness probe: :class:`GenerationLost`, raised by
  the route) is left for another: the request migrates, at most ``MAX_MIGRATIONS``
  times. It starts again as a new request (a new id, so a late token of the lost server
  is dropped) whose prompt is the original prompt plus every token the client already
  has, whose ``request_output_len`` (and ``min_tokens``) is what is left: prefilled on a
  context server, then decoded by another generation server, so the client's stream
  goes on with no token missing or repeated. Greedy text is the unmigrated text;
  sampling penalties and stop words then see the tokens sent before the move as prompt.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace
from typing import Awaitable, Callable, Protocol, Sequence

import numpy as np

from triton_disagg import log_format, protocol as P
from triton_disagg.config.roles import Mode
from triton_disagg.engine.sequence import EngineRequest, TokenEvent
from triton_disagg.errors import EngineError, GenerationLost, RequestError, Timeout, Unavailable
from triton_disagg.front.engine_calls import ResponseBuilder, handle_of
from triton_disagg.front.token_inbox import GenerationAnswer, TokenInbox, TokenStream
from triton_disagg.triton.tensors import engine_event, scalar

Send = Callable[[dict | None, bool], Awaitable[None]]  # (outputs or None: flags only, final)
CANCEL_POLL_SECONDS = 0.1   # is_cancelled() is an IPC round trip: asked at most this often
MAX_MIGRATIONS = 2          # a request leaves a lost generation server at most this often
MAX_RELEASES = 64           # release_kv calls out at once; beyond that leases reclaim the KV
MAX_ARRIVAL_AGE_SECONDS = 60.0   # an arrival stamp older than this is not believed (request_start)
_log = logging.getLogger(__name__)


class Route(Protocol):
    """One request's calls to context and generation (each transport decides where they go;
    a release goes to the context server that answered). ``cancellable``: cancelling a call
    stops it at the server (gRPC); a BLS call cannot be stopped once sent."""

    cancellable: bool

    async def context(self, request: EngineRequest,
                      listener: bytes = b"") -> dict[str, np.ndarray]:
        """Prefill ``request`` (overlapped: as ``listener``, generation's, reads the KV);
        the context's answer tensors (``CONTEXT_OUTPUTS``)."""

    async def generate(self, request: EngineRequest, request_type: str, token_address: str,
                       handle: bytes = b"") -> GenerationAnswer:
        """Send the request (``handle``: its prompt's KV, ``generation_only``); generation's
        answer (or EngineError)."""

    async def release(self, request: EngineRequest, handle: bytes) -> None:
        """Give the context the KV of ``handle`` (``context_phase_params``) back."""

    async def lost(self) -> GenerationLost | None:
        """Asked when the request's token stream has been silent a while: None while the
        generation server that accepted it still answers, else why it is lost."""

    def close(self) -> None:
        """The request ended (what the route counted in flight is taken off)."""


class Transport(Protocol):
    def route(self, request_id: str, avoid: frozenset[str], timeout: float) -> Route:
        """A request's route; its generation call goes to no server in ``avoid`` (urls of
        generation servers that were lost with it); each of its calls fails after
        ``timeout`` seconds without an answer."""


class RequestObserver(Protocol):
    """Hears each request's milestones (:class:`~triton_disagg.triton.metrics.Metrics`)."""

    def first_token(self, seconds: float) -> None:
        """The time to first token, from the request's arrival."""

    def finished(self, outcome: str, seconds: float, tokens: int, ttft: float | None) -> None:
        """The request ended (``outcome``: finished, cancelled or error)."""

    def migrated(self, url: str) -> None:
        """The request left the lost generation server at ``url``."""


def _call_id(client_id: str) -> str:
    """The id of one attempt's calls to context and generation (unique: generation keys its
    streams by it): the client's id (its first 64 characters) and a random suffix."""
    suffix = uuid.uuid4().hex
    return f"{client_id[:64]}-{suffix[:12]}" if client_id else suffix


class Orchestrator:
    """``tokens``: the instance's token inbox; ``decode``: token ids -> text; ``observer``
    (optional) hears each request's first token, end and migrations;
    ``local_prefill``: prompts of at most this many tokens skip the context; ``overlap``:
    generation takes a request before the context prefills it (module docstring)."""

    def __init__(self, transport: Transport, tokens: TokenInbox, mode: Mode,
                 decode: Callable[[Sequence[int]], str],
                 observer: RequestObserver | None = None,
                 local_prefill: int = 0, overlap: bool = False):
        self.transport, self.tokens, self.mode = transport, tokens, Mode(mode)
        self.decode, self.observer, self.local_prefill = decode, observer, local_prefill
        self.overlap = overlap
        self.releases: set[asyncio.Task] = set()   # release_kv calls in flight (held)

    async def handle(self, inputs: dict[str, np.ndarray], request: EngineRequest, send: Send,
                     is_cancelled: Callable[[], bool] = lambda: False,
                     client_id: str = "") -> str:
        """Serve one request; returns its outcome ("finished" or "cancelled"), or raises.
        ``inputs``: the orchestrator's (what the client's responses are built from);
        ``request``: the engine request they hold (the gate's,
        :meth:`~triton_disagg.front.engine_calls.OrchestratorGate.check`), all the calls
        carry. ``client_id``: the Triton request id the client set; the ids of the calls to
        context and generation start with it (else they are generated), so one grep finds
        the request's lines on every server; this task's log lines carry it."""
        run = ServedRequest(self, inputs, request, send, client_id)
        log_format.request_id.set(client_id or run.request_id)
        try:
            outcome = await run.serve(is_cancelled)
        except BaseException:
            run.done("error")
            raise
        finally:
            self.give_back(run)
            run.route.close()
        run.done(outcome)
        return outcome

    @property
    def aggregated(self) -> bool:
        """Every request goes to generation whole (``mode: aggregated``)."""
        return self.mode == Mode.AGGREGATED

    def give_back(self, run: "ServedRequest") -> None:
        """Release the context's KV that generation never took (``run.unfetched``), without
        delaying the client (the route and handle of now: a migrating request moves on to
        others); at most ``MAX_RELEASES`` such calls are out, beyond that the lease
        reclaims the KV. Called when a request ends or leaves a lost server, and when an
        abandoned context call answers late."""
        if not run.unfetched:
            return
        if len(self.releases) >= MAX_RELEASES:
            _log.warning("orchestrator: %d releases in flight; the KV of request %s waits "
                         "for its lease to expire", len(self.releases), run.request_id)
            return
        task = asyncio.get_running_loop().create_task(
            self._release(run.route, run.request, run.unfetched, run.request_id))
        self.releases.add(task)
        task.add_done_callback(self.releases.discard)

    async def _release(self, route: Route, request: EngineRequest, handle: bytes,
                       request_id: str) -> None:
        try:
            await route.release(request, handle)
        except Exception as exc:  # noqa: BLE001 - the lease still expires; say why it had to
            _log.warning("orchestrator: could not release the KV of request %s (%s); its "
                         "lease expires instead", request_id, exc)


def request_start(arrival_ns: int | None, now: float) -> float:
    """When a request's clock (its TTFT and latency metrics) starts, in ``time.monotonic()``
    seconds: preprocessing's ``arrival_ns`` stamp (same clock) when it is plausible, not
    after ``now`` and at most ``MAX_ARRIVAL_AGE_SECONDS`` before it, else ``now``. The stamp
    is not sealed (a client calling the models itself could write any), so a forged one
    moves a metric by at most that much."""
    if arrival_ns is None or not now - MAX_ARRIVAL_AGE_SECONDS <= arrival_ns / 1e9 <= now:
        return now
    return arrival_ns / 1e9


async def _done_unless_cancelled(future: asyncio.Future, is_cancelled: Callable[[], bool]
                                 ) -> bool:
    """Wait for ``future``, asking ``is_cancelled()`` every ``CANCEL_POLL_SECONDS``: True once
    it is done, False when the client cancelled first (``future`` is left as it is)."""
    while not (await asyncio.wait({future}, timeout=CANCEL_POLL_SECONDS))[0]:
        if is_cancelled():
            return False
    return True


class ServedRequest:
    """One request's state while the orchestrator serves it."""

    def __init__(self, owner: Orchestrator, inputs: dict[str, np.ndarray],
                 request: EngineRequest, send: Send, client_id: str = ""):
        self.owner, self.send, self.client_id = owner, send, client_id
        self.request_id = _call_id(client_id)
        self.builder = ResponseBuilder(inputs, owner.decode)
        self.request = request
        self.route = owner.transport.route(self.request_id, frozenset(),
                                           owner.tokens.stall_seconds)
        self.sent: list[int] = []           # every token id passed on to the client so far
        self.lost: frozenset[str] = frozenset()   # generation servers lost with this request
        self.start = request_start(scalar(inputs, P.ARRIVAL), time.monotonic())
        self.ttft: float | None = None
        self.unfetched: bytes | None = None   # the KV handle, until generation sends a token

    async def serve(self, is_cancelled: Callable[[], bool]) -> str:
        """The request to its end, migrating it off lost generation servers."""
        request, lost = self.request, None
        for moves in range(MAX_MIGRATIONS + 1):
            try:
                return await self.attempt(request, is_cancelled)
            except GenerationLost as exc:      # nothing left to move when all tokens went
                if moves == MAX_MIGRATIONS or len(self.sent) >= self.request.params.max_tokens:
                    raise Unavailable(f"{exc}; the request had moved {moves} times and sent "
                                      f"{len(self.sent)} tokens already") from None
                lost = exc
            except EngineError as exc:
                if lost is None:
                    raise
                moved = Timeout if isinstance(exc, Timeout) else Unavailable   # its code kept
                raise moved(f"{lost}; {exc}") from None     # why it had to move, too
            self.migrate(lost)
            request = self.resumed()
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def attempt(self, request: EngineRequest, is_cancelled: Callable[[], bool]) -> str:
        """Serve ``request``: on generation alone when aggregated or short, else context's
        prefill (its token goes out at once), then generation's decode of the rest."""
        prompt_length = len(request.prompt_ids)
        with_prompt_logprobs = request.params.prompt_logprobs is not None
        if self.owner.aggregated and with_prompt_logprobs:
            raise RequestError("prompt_logprobs (echo with logprobs): the log-probs of the "
                               "prompt's tokens are computed by a context server; this "
                               "deployment is aggregated (serve it disaggregated)")
        if self.owner.aggregated or (prompt_length <= self.owner.local_prefill
                                               and not with_prompt_logprobs):
            return await self.generate(request, P.CONTEXT_AND_GENERATION, is_cancelled)
        if self.owner.local_prefill and not with_prompt_logprobs:   # uncached part short?
            outcome = await self.generate(request, P.CONTEXT_AND_GENERATION_IF_CACHED,
                                          is_cancelled)
            if outcome is not None:
                return outcome
        if self.owner.overlap:
            return await self.overlapped(request, is_cancelled)
        ctx = await self.context(request, is_cancelled)
        if ctx is None:
            await self.send(None, True)
            return "cancelled"
        self.builder.context_answered(ctx)
        first = engine_event(self.request_id, ctx)
        if await self.emit(first):
            return "finished"
        self.unfetched = handle_of(ctx, needed=True)
        if is_cancelled():   # nothing fetched yet: the handle is given back
            await self.send(None, True)
            return "cancelled"
        # the prompt, then the first token; the handle holds the prompt's KV
        after_first = replace(request, prompt_ids=request.prompt_ids + first.tokens)
        return await self.generate(after_first, P.GENERATION_ONLY, is_cancelled,
                                   handle=self.unfetched)

    def migrate(self, lost: GenerationLost) -> None:
        """Leave the lost server: KV it never took goes back, and a new route under a new
        request id avoids every server lost so far."""
        _log.warning("orchestrator: %s; request %s moves on after %d tokens", lost,
                     self.request_id, len(self.sent))
        if self.owner.observer is not None:
            self.owner.observer.migrated(lost.url)
        self.owner.give_back(self)
        self.unfetched = None
        self.route.close()
        self.lost |= {lost.url}
        self.request_id = _call_id(self.client_id)
        self.route = self.owner.transport.route(self.request_id, self.lost,
                                                self.owner.tokens.stall_seconds)

    def resumed(self) -> EngineRequest:
        """The original request with every token sent so far appended to its prompt, only
        what is left to generate, its prompt's log-probs (sent already) not asked again."""
        params, sent = self.request.params, len(self.sent)
        return replace(self.request, prompt_ids=self.request.prompt_ids + self.sent,
                       params=replace(params, max_tokens=params.max_tokens - sent,
                                      min_tokens=max(0, params.min_tokens - sent),
                                      prompt_logprobs=None))

    async def context(self, request: EngineRequest, is_cancelled: Callable[[], bool],
                      listener: bytes = b"") -> dict[str, np.ndarray] | None:
        """The context call (its answer waits in the context's queue while its pool is full);
        None when the client cancelled meanwhile (asked every ``CANCEL_POLL_SECONDS`` while
        the call is out: the call is then abandoned)."""
        call = asyncio.ensure_future(self.route.context(request, listener))
        try:
            return call.result() if await _done_unless_cancelled(call, is_cancelled) else None
        finally:       # the client left (or this task was cancelled): stop the call
            if self.route.cancellable or call.done():
                call.cancel()
            else:      # a BLS call runs on: the KV it brings back goes back
                call.add_done_callback(self._late_context)

    def _late_context(self, call: asyncio.Future) -> None:
        """An abandoned context call answered after all: its handle's KV goes back now,
        not when its lease expires."""
        if not call.cancelled() and call.exception() is None:
            self.unfetched = handle_of(call.result())
            self.owner.give_back(self)

    async def overlapped(self, request: EngineRequest, is_cancelled: Callable[[], bool]) -> str:
        """Generation first, then, once it holds the request's blocks, the context given
        generation's listener; the context's first token goes out, then generation's tokens
        (module docstring). Leaving early in any way stops generation, which frees the
        blocks it took."""
        with self.owner.tokens.open(self.request_id) as stream:
            answer = await stream.accept(self.route.generate(
                request, P.GENERATION_AWAITING_CONTEXT, stream.token_address))
            ctx = None
            if await self.taken(stream, is_cancelled):
                ctx = await self.context(request, is_cancelled, answer.kv_listener)
            if ctx is None:
                await self.send(None, True)
                return "cancelled"
            self.builder.context_answered(ctx)
            if await self.emit(engine_event(self.request_id, ctx)):
                return "finished"
            self.unfetched = handle_of(ctx)
            return await self.relay(stream, is_cancelled)

    async def taken(self, stream: TokenStream, is_cancelled: Callable[[], bool]) -> bool:
        """Wait until generation holds the overlapped request's blocks (its event with no
        tokens), so that the context never prefills KV generation has no room for (module
        docstring of :mod:`triton_disagg.generation.decode_loop`); False when the client
        cancelled meanwhile (asked every ``CANCEL_POLL_SECONDS``). Generation's error, or its
        silence for ``stall_seconds``, raises."""
        event = asyncio.ensure_future(stream.next(self.route.lost))
        try:
            if not await _done_unless_cancelled(event, is_cancelled):
                return False
            taken = event.result()
        finally:
            event.cancel()
        if taken.final:
            raise Unavailable(f"generation ended the request ({taken.finish_reason}) before "
                              f"the context was called")
        if taken.tokens:
            raise EngineError(f"generation sent {len(taken.tokens)} token(s) for an overlapped "
                              f"request before it took the request's blocks")
        return True

    async def generate(self, request: EngineRequest, request_type: str,
                       is_cancelled: Callable[[], bool], handle: bytes = b"") -> str | None:
        """Send generation the request, then pass its tokens on until the final one; leaving
        early in any way stops generation (the stream's exit). None: generation declined it
        (``context_and_generation_if_cached``: its prompt is not cached there)."""
        tokens = self.owner.tokens
        with tokens.open(self.request_id) as stream:
            answer = await stream.accept(self.route.generate(request, request_type,
                                                             stream.token_address, handle))
            if answer.declined:
                return None
            return await self.relay(stream, is_cancelled)

    async def relay(self, stream: TokenStream, is_cancelled: Callable[[], bool]) -> str:
        """Pass generation's tokens on until the final one (the client's cancel asked at
        most every ``CANCEL_POLL_SECONDS``)."""
        asked = 0.0   # when is_cancelled() was last asked
        while True:
            event = await stream.next(self.route.lost)
            self.unfetched = None       # generation made a token: it took the KV
            if not event.final and time.monotonic() - asked >= CANCEL_POLL_SECONDS:
                asked = time.monotonic()
                if is_cancelled():
                    await self.send(None, True)
                    return "cancelled"
            if await self.emit(event):
                return "cancelled" if event.finish_reason == "cancelled" else "finished"

    async def emit(self, event: TokenEvent) -> bool:
        """Pass an event on; True when it was the last. The first event ends the time to first
        token (from the request's arrival at preprocessing, or here without that stamp)."""
        self.sent += event.tokens
        out = self.builder.add(event)
        if out is not None:
            await self.send(out, event.final)
        if self.ttft is None:   # the first token went out (streaming) or reached here, so the
            self.ttft = time.monotonic() - self.start   # per-token interval starts as the client's
            if self.owner.observer is not None:
                self.owner.observer.first_token(self.ttft)
        return event.final

    def done(self, outcome: str) -> None:
        _log.info("request %s: %s after %.3f s, %d tokens", self.request_id, outcome,
                  time.monotonic() - self.start, self.builder.generated)
        if self.owner.observer is not None:
            self.owner.observer.finished(outcome, time.monotonic() - self.start,
                                         self.builder.generated, self.ttft)

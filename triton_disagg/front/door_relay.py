"""How the public gRPC door (:mod:`.public_door`) relays a call to tritonserver and its
answers back: a client's ``ModelStreamInfer`` stream as one inner stream per message
(:class:`StreamRelay`), the caller's metadata (:func:`forwarded_metadata`), a response
written to the caller within its time (:func:`write_within`) and how the door ends a call
(:class:`Ending`). Times asked of a client are on the doors' :class:`LoopClock`, so the
door's own stalls never count against it."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from triton_disagg.front.door_guards import (UNREACHABLE, BudgetFull, ByteBudget, LoopClock,
                                             MessageScreen, Refused, Taken, message_cost)
from triton_disagg.front.call_seats import Seat, worked_rank
from triton_disagg.triton.endpoints import LOOPBACK

DROPPED_METADATA = frozenset({"user-agent", "content-type", "te", "host"})  # and grpc-*, :*
QUEUED_RESPONSES = 64       # responses of one client stream waiting for the client
STREAM_CALLS = 64           # messages of one client stream at tritonserver at once
_ENDED = object()           # a stream relay's last item
EVICTED = "the call was idle and was ended to make room for another; call again"


@dataclass(frozen=True)
class RelayLimits:
    """What a relayed call may take: ``max_bytes`` of the door's budget for one client
    stream (or one message), ``idle_seconds`` with no message either way,
    ``write_seconds`` for the caller to take one response, ``answer_seconds`` for it to
    take a response after tritonserver gave it."""

    max_bytes: int
    idle_seconds: float
    write_seconds: float
    answer_seconds: float


def answered(response: bytes) -> bool:
    """Whether a ``ModelStreamInferResponse`` answers its request (an error's
    ``error_message``, field 1, is serialized first: tag 0x0A): only answers are a stream's
    work, so requests Triton refuses at once protect no place."""
    return not response.startswith(b"\n")


def forwarded_metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str | bytes], ...]:
    """The caller's metadata less what the transport sets itself."""
    return tuple((key, value) for key, value in context.invocation_metadata() or ()
                 if key not in DROPPED_METADATA and not key.startswith((":", "grpc-")))


class Ending(Exception):
    """How the door ends a caller's call: the arguments of ``context.abort``."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()):
        super().__init__(code, details, trailing)

    @classmethod
    def relayed(cls, exc: grpc.aio.AioRpcError) -> Ending:
        """As tritonserver ended the door's call; a failure to reach it is said without its
        address."""
        details = exc.details() or ""
        if exc.code() is grpc.StatusCode.UNAVAILABLE and LOOPBACK in details:
            details = UNREACHABLE
        return cls(exc.code(), details, exc.trailing_metadata() or ())


async def write_within(context: grpc.aio.ServicerContext, response: bytes, seconds: float,
                       clock: LoopClock, seat: Seat) -> None:
    """Write one response to the caller; raises :class:`Ending` (DEADLINE_EXCEEDED) when it
    takes none for ``seconds`` (of ``clock``), so that the caller lets go of what it holds
    before the status, which waits behind the unread responses, is sent; such a write marks
    ``seat.unread``. While it writes, ``seat.writing`` (an eviction then lets it finish)."""
    seat.writing = True
    try:
        await clock.finish_by(clock.now() + seconds, context.write(response))
    except TimeoutError:
        seat.unread = True
        raise Ending(grpc.StatusCode.DEADLINE_EXCEEDED,
                     f"the client read no response for {seconds:g} s") from None
    finally:
        seat.writing = False


@dataclass(frozen=True)
class Refusal:
    """A refused stream message's answer, in the stream as Triton gives one (a
    ``ModelStreamInferResponse`` of ``error_message`` and the request's id: the client's
    other requests on that stream go on); written like a response, but no work of the
    stream's."""

    answer: bytes

    @classmethod
    def of(cls, refused: Refused) -> Refusal:
        from tritonclient.grpc import service_pb2

        return cls(service_pb2.ModelStreamInferResponse(
            error_message=str(refused),
            infer_response=service_pb2.ModelInferResponse(id=refused.request_id)
        ).SerializeToString())


class StreamRelay:
    """One client's ``ModelStreamInfer`` call. Each of its messages is its own inner
    ``ModelStreamInfer`` call to tritonserver (one message, then half-closed; Triton ends it
    after that request's last response), so tritonserver never writes two requests'
    responses on one stream (Triton 2.51 can abort writing an error response on a stream
    that is streaming another's) and a message's bytes are held in the door's ``budget``
    until Triton has let that request go, however many responses it gives, of the stream's
    own :class:`~.door_guards.Reserve` first (so its small messages never wait for others'
    bytes), the rest of the shared pool; a stream holds at most ``STREAM_CALLS`` messages
    and ``limits.max_bytes`` (or one message) of it.
    Responses come back in the order they arrive, through a queue of ``QUEUED_RESPONSES``;
    a refused message is answered in the stream (:class:`Refusal`) and the stream goes on;
    the call ends when the client has half-closed and every inner call has ended, at the
    first inner failure (as tritonserver ended it), when the door's budget has as many
    bytes waiting as it holds (RESOURCE_EXHAUSTED), after ``idle_seconds`` with no message
    either way, when one write waits ``write_seconds`` or the client takes a response
    ``answer_seconds`` after tritonserver gave it (a client that reads slowly holds the
    budget no longer than one that reads nothing); every inner call is cancelled and every
    byte given back then."""

    def __init__(self, budget: ByteBudget, clock: LoopClock, limits: RelayLimits,
                 method: grpc.aio.StreamStreamMultiCallable, screen: MessageScreen,
                 context: grpc.aio.ServicerContext, seat: Seat):
        self.budget, self.clock, self.limits = budget, clock, limits
        self.method, self.screen, self.context, self.seat = method, screen, context, seat
        self.answers: asyncio.Queue[tuple[float, object]] = asyncio.Queue(QUEUED_RESPONSES)
        self.calls: set[asyncio.Task[None]] = set()
        self.room = asyncio.Semaphore(STREAM_CALLS)
        self.reserve = budget.reserve()
        self.reader: asyncio.Task[None] | None = None   # reads the client's messages
        self.share = ByteBudget(limits.max_bytes)
        self.reading = True
        self.last = clock.now()                   # a message either way
        self.worked, self.moved = False, self.last   # work: an answer; when it last moved

    def rank(self) -> tuple[bool, float] | None:
        """Whether the door's roster may end this stream to make room for another call, and
        in what order: None while a request of its is at tritonserver (not while one waits
        for the budget: ended, it holds none), or while its work (an answer,
        :func:`answered`, given or written) moved within ``EVICT_GRACE_SECONDS``; else
        (whether it ever worked, when its work last moved): a stream of refusals, errors or
        nothing goes first, then the one idle longest, so a client blocking its writes or
        sending what is refused holds no place. A stream ended for room holds no bytes (of
        its reserve neither)."""
        if self.calls:
            return None
        return worked_rank(self.moved, self.clock.now()) if self.worked else (False, self.moved)

    async def run(self, requests: AsyncIterator[bytes]) -> None:
        """Relay until the end; every inner call is cancelled (its bytes given back) before
        the caller's status is sent."""
        self.reader = asyncio.get_running_loop().create_task(self._read(requests))
        try:
            await self._relay()
        except Ending as ending:
            self.stop_work()
            await self.context.abort(*ending.args)
        finally:
            self.stop_work()

    def stop_work(self) -> None:
        """Read no more of the client and cancel every inner call (each gives its bytes
        back): at the end, and when the call is ended for room mid-answer (only the write
        under way then finishes, :class:`.call_seats.Seat`)."""
        if self.reader is not None:
            self.reader.cancel()
        for call in list(self.calls):
            call.cancel()

    async def _relay(self) -> None:
        while (queued := await self._next())[1] is not _ENDED:
            given, item = queued
            if isinstance(item, Ending):
                raise item
            if (late := self.clock.now() - given) > self.limits.answer_seconds:
                raise Ending(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"the client took a response {late:.0f} s after tritonserver "
                             f"gave it (at most {self.limits.answer_seconds:g} s)")
            answer = item.answer if isinstance(item, Refusal) else item
            await write_within(self.context, answer, self.limits.write_seconds, self.clock,
                               self.seat)
            if self.seat.evicted:              # ended for room while it wrote: the last
                raise Ending(grpc.StatusCode.UNAVAILABLE, EVICTED)
            self.last = self.clock.now()
            if isinstance(item, bytes) and answered(item):
                self.moved = self.last

    async def _next(self) -> tuple[float, object]:
        """(when it was queued, the next response, failure or ``_ENDED``); the call ends
        idle past its time."""
        while True:
            left = self.last + self.limits.idle_seconds - self.clock.now()
            if left <= 0:
                raise Ending(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"no message either way for {self.limits.idle_seconds:g} s")
            try:                  # woken by wall time; whether idle is asked of the clock
                async with asyncio.timeout(left):
                    return await self.answers.get()
            except TimeoutError:
                continue

    async def _read(self, requests: AsyncIterator[bytes]) -> None:
        """Read a message only once the stream has a place for it (a message the door
        has read waits counted in the door's budget, never outside it)."""
        messages = aiter(requests)
        try:
            while True:
                await self.room.acquire()
                if (raw := await anext(messages, None)) is None:
                    self.room.release()
                    break
                self.last = self.clock.now()
                try:
                    taken = await self._take(raw)
                except BaseException:
                    self.room.release()
                    raise
                del raw                     # held by the call alone, counted in the budget
                if isinstance(taken, tuple):
                    self._start(*taken)
                else:
                    self.room.release()
                    await self._queue(taken)
                    if isinstance(taken, Ending):
                        return
                taken = None
        except Exception as exc:                   # the door's own fault: said, not hung
            await self._queue(Ending(grpc.StatusCode.INTERNAL,
                                     f"the door failed: {type(exc).__name__}"))
            return
        finally:
            self.reading = False
        await self._end_if_done()

    async def _take(self, raw: bytes) -> tuple[bytes, Taken, Taken] | Refusal | Ending:
        """``raw`` screened and its bytes taken (:meth:`_admit`): (the message to forward,
        what it holds of the door's budget and of the stream's share); else, nothing
        taken, a refused message's answer (:class:`Refusal`) or, when the door's budget
        has as many bytes waiting as it holds, how the stream ends. Neither keeps ``raw``
        or the refusal (and its traceback's frames) alive."""
        try:
            request = self.screen(raw)
        except Refused as refused:
            return Refusal.of(refused)
        try:
            return (request, *await self._admit(message_cost(request, True)))
        except BudgetFull as full:
            return Ending(grpc.StatusCode.RESOURCE_EXHAUSTED, str(full))

    def _start(self, request: bytes, door: Taken, share: Taken) -> None:
        """``request``'s inner call, what it holds given back when it ends
        (:meth:`_ended`)."""
        call = asyncio.get_running_loop().create_task(self._call(request))
        self.calls.add(call)
        call.add_done_callback(functools.partial(self._ended, door, share))

    async def _admit(self, cost: int) -> tuple[Taken, Taken]:
        """``cost`` bytes of the door's budget (the stream's reserve first), then of the
        stream's share (so bytes waiting for the stream are counted door-wide); both or
        neither (:class:`BudgetFull`, or cancelled)."""
        door = await self.budget.take(cost, self.reserve)
        try:
            return door, await self.share.take(cost)
        except BaseException:
            self.budget.give(door)
            raise

    def _ended(self, door: Taken, share: Taken, call: asyncio.Task[None]) -> None:
        """An inner call's end, however it ended (cancelled before it began too): its
        bytes and its place in the stream given back."""
        self.budget.give(door)
        self.share.give(share)
        self.room.release()
        self.calls.discard(call)

    async def _queue(self, item: object) -> None:
        await self.answers.put((self.clock.now(), item))

    async def _call(self, request: bytes) -> None:
        """One message's inner call: its responses onto the queue, or how it failed; the
        last call to end after the client half-closed ends the relay."""
        call: grpc.aio.StreamStreamCall | None = None
        try:
            call = self.method(metadata=forwarded_metadata(self.context),
                               timeout=self.context.time_remaining())
            await call.write(request)
            await call.done_writing()
            async for response in call:
                await self._queue(response)
                if answered(response):
                    self.worked, self.moved = True, self.clock.now()
        except grpc.aio.AioRpcError as exc:
            await self._queue(Ending.relayed(exc))
        except Exception as exc:                   # the door's own fault: said, not hung
            await self._queue(Ending(grpc.StatusCode.INTERNAL,
                                     f"the door failed: {type(exc).__name__}"))
        finally:
            if call is not None:
                call.cancel()                      # no-op once done
        self.calls.discard(asyncio.current_task())
        await self._end_if_done()

    async def _end_if_done(self) -> None:
        """After the client half-closed and the last inner call ended (not when the relay
        cancels them): the relay's end."""
        if not self.reading and not self.calls:
            await self._queue(_ENDED)

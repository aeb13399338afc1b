"""What every door checks before it forwards (:mod:`.public_door`, :mod:`.http_door`,
:mod:`.metrics_door`): that the inner port is tritonserver's (:class:`InnerOwner`), what an
inference request message holds (:class:`MessageScreen`), how many bytes forwarded
requests hold until Triton lets them go (:class:`ByteBudget`, door-wide, with each call's
:class:`Reserve`), and the clock that times the doors' clients without the doors' own
stalls (:class:`LoopClock`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, TypeVar

OWNER_CHECK_SECONDS = 1.0   # how long an inner port's owner check is trusted
UNREACHABLE = "tritonserver is not reachable"
MAX_ENTRIES = 65_536        # strings, tensors and parameters of one inference request
MAX_NUMBERS = 4 * 2**20     # numbers in its contents and shapes
MAX_ID_CHARS = 1024         # its request id (Triton echoes it in every response)
OUTSTANDING_MESSAGES = 8    # max_outstanding, in messages of max_bytes
MESSAGE_FLOOR = 16 * 1024   # bytes a message is charged at least (Triton's cost of a request)
CALL_RESERVE = 256 * 1024   # bytes of a client's call that never wait (32K tokens' text: ~128 KB)
CLIENT_SECONDS = 10.0       # a client takes an answer (gRPC: a response) within this long
LAG_TICK_SECONDS = 0.05     # how often the loop clock measures its event loop's lag
LAG_SHARE = 0.5             # of the time that passes, at most this much is loop lag
# 127.0.0.1 as /proc/net/tcp writes it, and as tcp6 writes ::ffff:127.0.0.1 (how grpc core
# binds "127.0.0.1" where IPv6 is up)
LOOPBACK_HEX = {"/proc/net/tcp": "0100007F", "/proc/net/tcp6": "0000000000000000FFFF00000100007F"}


T = TypeVar("T")


class InnerOwner:
    """Whether a socket of this process's user listens on 127.0.0.1 (or ::ffff:127.0.0.1) on
    each inner port, from ``/proc/net/tcp`` and ``tcp6``. Linux gives a connection to
    127.0.0.1:P to that exact listener before any wildcard one, and while it listens no
    other user can bind 127.0.0.1:P (nor join it: SO_REUSEPORT is shared within one
    uid), so then the port is tritonserver's; listeners of others elsewhere (0.0.0.0,
    ::, 127.0.0.2) take none of the door's connections and are ignored. A yes is trusted
    for ``OWNER_CHECK_SECONDS``; a no is asked again at the next request (tritonserver
    opens its ports only once its models are loaded, and a probe just after must see them).
    The tables are read on a worker thread, one read at a time whoever asks (a host's table
    of 60,000 sockets took 49 ms of the doors' event loop to parse), for their listeners'
    rows alone."""

    def __init__(self, ports: tuple[int, ...]):
        self.ports, self.uid = ports, os.geteuid()
        self._checked, self._ours = -OWNER_CHECK_SECONDS, False
        self._reading: asyncio.Future[bool] | None = None

    async def ours(self) -> bool:
        if self._ours and time.monotonic() - self._checked < OWNER_CHECK_SECONDS:
            return True
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read())
        return await asyncio.shield(self._reading)

    async def _read(self) -> bool:
        try:
            started = time.monotonic()
            ours = await asyncio.to_thread(self.check)
            self._checked, self._ours = started, ours
            return ours
        finally:
            self._reading = None

    def check(self) -> bool:
        """The tables read now (blocking): whether every inner port is this user's."""
        return all(self._listener_uid(port) == self.uid for port in self.ports)

    @staticmethod
    def _listener_uid(port: int) -> int | None:
        """The uid of the socket listening on 127.0.0.1:``port`` (its row: ``sl: local
        remote st tx:rx tr:when retrnsmt uid ...``, a listener's remote all zeros, its state
        0A), or None."""
        for table, loopback in LOOPBACK_HEX.items():
            try:
                text = Path(table).read_text()
            except OSError:
                continue
            zeros = "0" * len(loopback)
            at = text.find(f" {loopback}:{port:04X} {zeros}:0000 0A ")
            if at >= 0:
                return int(text[at:text.find("\n", at)].split()[6])
        return None


class Refused(Exception):
    """Why the door refuses a request message (INVALID_ARGUMENT), and the request's ``id``
    when the message named one."""

    def __init__(self, message: str, request_id: str = ""):
        super().__init__(message)
        self.request_id = request_id


def inference_size(request) -> tuple[int, int]:
    """(entries, numbers) of a parsed ``ModelInferRequest``: the strings, tensors and
    parameters Triton's protobuf holds as one object each, and the numbers of numeric
    contents and shapes, each held in 4-8 bytes however short its varint."""
    entries = len(request.parameters) + len(request.raw_input_contents)
    numbers = 0
    for tensor in (*request.inputs, *request.outputs):
        entries += 1 + len(tensor.parameters)
    for tensor in request.inputs:
        c = tensor.contents
        entries += len(c.bytes_contents)
        numbers += len(tensor.shape) + sum(map(len, (
            c.bool_contents, c.int_contents, c.int64_contents, c.uint_contents,
            c.uint64_contents, c.fp32_contents, c.fp64_contents)))
    return entries, numbers


def refuse_unserved(model: str, models: frozenset[str]) -> None:
    """Raise :class:`Refused` when ``models`` is given and ``model`` is not one of them."""
    if models and model not in models:
        raise Refused(f"model {model[:100]!r} is not served here")


class MessageScreen:
    """What the door forwards of one method's request message: the message parsed with
    tritonclient's protobuf types and serialized again without the fields those types do not
    know (Triton's protobuf would keep each: 10 MiB of empty unknown fields took 330 MB), and,
    for an inference request (``infer``), one that names a model of ``models`` (when given:
    Triton 2.51 can die answering an unknown model on a stream that is streaming) with at
    most ``MAX_ENTRIES`` strings, tensors and parameters, ``MAX_NUMBERS`` numbers and an
    ``id`` of at most ``MAX_ID_CHARS`` (Triton echoes it in every response, which the door
    relays: a 9 MiB id in each of 64 unread responses held ~0.9 GB a stream). Calling it
    returns the bytes to forward or raises :class:`Refused` (with the request's id, cut to
    its bound)."""

    def __init__(self, request_type, infer: bool, models: frozenset[str] = frozenset()):
        self.request_type, self.infer, self.models = request_type, infer, models

    def __call__(self, raw: bytes) -> bytes:
        from google.protobuf.message import DecodeError

        try:
            parsed = self.request_type.FromString(raw)
        except DecodeError:
            raise Refused(f"the message is not a {self.request_type.__name__}") from None
        parsed.DiscardUnknownFields()
        if self.infer:
            try:
                self._screen_inference(parsed)
            except Refused as refused:
                raise Refused(str(refused), parsed.id[:MAX_ID_CHARS]) from None
        return parsed.SerializeToString()

    def _screen_inference(self, parsed) -> None:
        if len(parsed.id) > MAX_ID_CHARS:
            raise Refused(f"the request id has {len(parsed.id)} characters; at most "
                          f"{MAX_ID_CHARS}")
        refuse_unserved(parsed.model_name, self.models)
        entries, numbers = inference_size(parsed)
        if entries > MAX_ENTRIES:
            raise Refused(f"the request has {entries} strings, tensors and parameters; at "
                          f"most {MAX_ENTRIES} (send a long tensor as raw_input_contents)")
        if numbers > MAX_NUMBERS:
            raise Refused(f"the request has {numbers} numbers in contents and shapes; at "
                          f"most {MAX_NUMBERS} (send a long tensor as raw_input_contents)")


def message_cost(request: bytes, infer: bool) -> int:
    """What a forwarded request message holds of the door's budget: an inference request its
    bytes, and at least ``MESSAGE_FLOOR``, so that many small ones are bounded too; any other
    (health, metadata: answered at once) nothing unless it is larger than that."""
    if infer:
        return max(len(request), MESSAGE_FLOOR)
    return len(request) if len(request) > MESSAGE_FLOOR else 0


class BudgetFull(Exception):
    """As many bytes wait for the budget as it holds: the message is refused at once."""


class Reserve:
    """One admitted call's own bytes of a :class:`ByteBudget` (a gRPC call in its door's
    roster, an HTTP request under its door's request count): at most ``size`` held at
    once, taken without waiting for anyone (:meth:`ByteBudget.take`). ``held``: its bytes
    held now."""

    def __init__(self, size: int):
        self.size, self.held = size, 0


@dataclass(frozen=True)
class Taken:
    """What one :meth:`ByteBudget.take` holds until its :meth:`ByteBudget.give`:
    ``reserved`` bytes of ``reserve`` (None: no call's) and ``pooled`` of the shared pool."""

    reserve: Reserve | None
    reserved: int
    pooled: int


class ByteBudget:
    """Bytes of request messages forwarded and not yet answered, door-wide. Each admitted
    call has a :class:`Reserve` of ``per_call`` bytes (:meth:`reserve`); a message's bytes
    come from its call's reserve first, at once, and only the rest from the shared pool of
    ``limit``, so a call's small messages never wait for others' large ones. The pool:
    :meth:`take` waits while taking its part would pass ``limit`` (unless the pool holds
    nothing), so the pool holds at most ``limit`` (or one message); takers are served in
    the order they came (a large message is not passed for ever by small ones); a part of 0
    never waits; a part that would make the bytes waiting more than ``limit`` raises
    :class:`BudgetFull` at once (a waiting message is in the door's memory, outside the
    pool). So the door holds at most ``limit`` + calls x ``per_call`` bytes of requests
    (calls: its roster's seats and request count's places, each call one reserve). Every
    :meth:`take` that returns is matched by one :meth:`give` of what it returned; one
    cancelled or refused holds nothing, of the reserve or the pool. ``held``: the pool's
    bytes held; ``reserved``: the reserves'."""

    def __init__(self, limit: int, per_call: int = 0):
        self.limit, self.per_call = limit, per_call
        self.held, self.reserved, self.waiting = 0, 0, 0
        self._queue: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def reserve(self) -> Reserve:
        """A new call's reserve (one per call: the bound counts one each)."""
        return Reserve(self.per_call)

    async def take(self, n: int, reserve: Reserve | None = None) -> Taken:
        """``n`` bytes: of ``reserve`` what it has free, at once; the rest of the pool."""
        own = min(n, reserve.size - reserve.held) if reserve is not None else 0
        self._count_reserved(reserve, own)
        try:
            await self._pool(n - own)
        except BaseException:
            self._count_reserved(reserve, -own)
            raise
        return Taken(reserve, own, n - own)

    async def take_within(self, n: int, seconds: float,
                          reserve: Reserve | None = None) -> Taken:
        """:meth:`take`, waiting at most ``seconds`` (then :class:`BudgetFull`)."""
        try:
            async with asyncio.timeout(seconds):
                return await self.take(n, reserve)
        except TimeoutError:
            raise BudgetFull(f"over {self.limit} bytes of requests have been at tritonserver "
                             f"for {seconds:g} s; retry later") from None

    def give(self, taken: Taken) -> None:
        self._count_reserved(taken.reserve, -taken.reserved)
        self._unpool(taken.pooled)

    def _count_reserved(self, reserve: Reserve | None, n: int) -> None:
        if reserve is not None:
            reserve.held += n
            self.reserved += n

    async def _pool(self, n: int) -> None:
        if n == 0 or (not self._queue and self._fits(n)):
            self.held += n
            return
        if self.waiting and self.waiting + n > self.limit:
            raise BudgetFull(f"{self.waiting} bytes of requests already wait for the door's "
                             f"{self.limit}; retry later")
        turn = (n, asyncio.get_running_loop().create_future())
        self._queue.append(turn)
        self.waiting += n
        try:
            await turn[1]
        except asyncio.CancelledError:
            if turn[1].done() and not turn[1].cancelled():
                self._unpool(n)                    # granted, then cancelled: not held
            elif turn in self._queue:              # not yet skipped by _grant
                self._queue.remove(turn)
                self.waiting -= n
                self._grant()
            raise

    def _unpool(self, n: int) -> None:
        self.held -= n
        self._grant()

    def _fits(self, n: int) -> bool:
        return not self.held or self.held + n <= self.limit

    def _grant(self) -> None:
        """Grant the turns at the head that fit; a turn cancelled while queued is dropped
        (its taker has not yet run its ``except``: it finds itself gone)."""
        while self._queue and (self._queue[0][1].done() or self._fits(self._queue[0][0])):
            n, turn = self._queue.popleft()
            self.waiting -= n
            if not turn.done():
                self.held += n
                turn.set_result(None)


class LoopClock:
    """The doors' clock for what they ask of a client (to take an answer, a response, in
    time): monotonic time less the event loop's lag, how late a tick of ``tick`` seconds
    woke (a stall still in progress included), but never more than ``LAG_SHARE`` of the
    time that passed: the door's own stalls (a 10 MiB message parsed on the loop: ~90 ms)
    do not count against a client that reads at once, and a client that keeps the loop
    busy stretches the others' times at most 1 / (1 - ``LAG_SHARE``) fold. Between
    :meth:`start` and :meth:`stop` it ticks; stopped, it is monotonic time less the lag it
    measured."""

    def __init__(self, tick: float = LAG_TICK_SECONDS):
        self.tick, self.lag = tick, 0.0
        self._began, self._due = math.inf, math.inf       # the tick running now
        self._ticker: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Tick on the running loop (again: nothing)."""
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker, self._began, self._due = None, math.inf, math.inf

    def now(self) -> float:
        wall = time.monotonic()
        return wall - self.lag - self._late(wall)

    async def finish_by(self, deadline: float, work: Awaitable[T]) -> T:
        """``work``'s result if it ends before ``deadline`` (on this clock); else
        ``TimeoutError``, ``work`` cancelled (so too when the caller is)."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                if (left := deadline - self.now()) <= 0:
                    raise TimeoutError
                await asyncio.wait((task,), timeout=left)
            return task.result()
        finally:
            task.cancel()                          # no-op once done

    def _late(self, wall: float) -> float:
        """The running tick's lag at ``wall``: how late it is, at most ``LAG_SHARE`` of
        the time since it began."""
        return min(max(0.0, wall - self._due), max(0.0, wall - self._began) * LAG_SHARE)

    async def _tick(self) -> None:
        while True:
            self._began = time.monotonic()
            self._due = self._began + self.tick
            await asyncio.sleep(self.tick)
            self.lag += self._late(time.monotonic())

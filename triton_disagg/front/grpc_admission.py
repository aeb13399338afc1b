"""Who gets into the public gRPC door (:mod:`.public_door`): its connections, accepted here
and piped byte for byte to the door's grpc server on a loopback port of its own
(:class:`ConnectionGate`), and its calls (:class:`Roster` of :class:`Seat`). Both are capped
the same way: a newcomer past the cap takes the place of the one that does least
(:meth:`Roster.enter`), so places held doing nothing never keep a working client out.

Why a gate: grpcio caps connections (``grpc.max_allowed_incoming_connections``) but cannot
end an open one to make room, so clients that reconnect as each silent connection is closed,
or start an empty call every few seconds, held every place (scaled to 8 connections, a
victim failed 15 of 15 tries). The gate sees every connection, and the door tells it which
of a connection's calls work: a call's peer is the gate's end of that connection's pipe
(``ipv4:127.0.0.1:PORT``), so :meth:`ConnectionGate.connection` finds it."""

from __future__ import annotations

import asyncio
import collections
from typing import Callable

from triton_disagg.front.door_guards import LoopClock
from triton_disagg.triton.endpoints import LOOPBACK

EVICT_GRACE_SECONDS = 2.0   # a place whose work moved this recently is not taken for room
SETTLE_SECONDS = 0.2        # nor a connection this new: time to say its first bytes
PIPE_BUFFER_BYTES = 256 * 1024   # bytes one side of a pipe buffers before the other pauses
ROOM_PER_SECOND = 128       # connections the gate ends to make room, a second at most
ADDRESS_ROOM_PER_SECOND = 16     # of them for newcomers from one address
ACCEPT_BACKLOG = 128        # connections the kernel queues (one accept callback takes them)
Rank = tuple | None          # None: not to be ended; else what orders it, lowest ended first


def worked_rank(moved: float, now: float) -> Rank:
    """The rank of a place whose work (an inference answered, not an error) last moved at
    ``moved``: kept within ``EVICT_GRACE_SECONDS``, then (True, ``moved``)."""
    return None if now - moved < EVICT_GRACE_SECONDS else (True, moved)


class Seat:
    """One call's place under the door's cap: whether it may be ended to make room, and in
    what order (``rank()``: None, not; else lowest first, as
    :meth:`.door_relay.StreamRelay.rank`), and whether it was ended for that. It starts
    :meth:`unworked`; only inference answered (not an error, not a health or metadata call)
    is work, so cheap calls protect neither the seat nor its connection."""

    def __init__(self, entered: float):
        self.task = asyncio.current_task()
        self.entered = entered
        self.rank: Callable[[], Rank] = self.unworked
        self.evicted = False
        self.unread = False        # ended while its client read none of an answer

    def unworked(self) -> Rank:
        return False, self.entered

    def evict(self) -> None:
        self.evicted = True
        if self.task is not None:
            self.task.cancel()


class Roster:
    """At most ``limit`` places (anything with ``rank()`` and ``evict()``): one past it takes
    the place that ranks first (``rank()``: a place that never did work, a refusal's or
    nothing, then the one whose work moved longest ago), which is evicted, or, with none to
    take (every rank None), is refused. So places held doing nothing (a call that never
    sends, one that sends refusals and reads nothing, a silent connection) never keep a
    working one out: 64 such calls from one connection had refused every other client until
    they left."""

    def __init__(self, limit: int):
        self.limit, self.seats = limit, set()

    def enter(self, seat) -> bool:
        if len(self.seats) >= self.limit:
            ranked = [(rank, taken) for taken in self.seats
                      if (rank := taken.rank()) is not None]
            if not ranked:
                return False
            _, first = min(ranked, key=lambda pair: pair[0])
            self.seats.discard(first)
            first.evict()
        self.seats.add(seat)
        return True

    def leave(self, seat) -> None:
        self.seats.discard(seat)


class GatedConnection(asyncio.Protocol):
    """One client connection, piped to the door's grpc server (:class:`_InnerEnd`). It
    ranks (:meth:`rank`) by its calls' seats: None while one of them works (or its work
    moved within ``EVICT_GRACE_SECONDS``), else first by its address (the one with the
    most connections open goes first, so clients that reconnect from one address take
    each other's places, not another's), then as a call would: one whose calls never did
    work (first one that never sent a byte, then one that made only empty calls), then the
    one whose work moved longest ago. Evicted or ended from either end, both ends are aborted (never
    a normal end: a call in flight sees the connection lost)."""

    def __init__(self, gate: ConnectionGate):
        self.gate = gate
        self.client: asyncio.Transport | None = None
        self.inner: asyncio.Transport | None = None
        self.seats: set[Seat] = set()
        self.worked, self.moved = False, gate.clock.now()
        self.address: str | None = None
        self.spoke = False                     # the client sent a byte
        self.opening: asyncio.Task[None] | None = None   # the inner end, until it is open

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client = transport                # type: ignore[assignment]
        self.address = (transport.get_extra_info("peername") or ("?",))[0]
        self.gate.per_address[self.address] += 1
        if not self.gate.admit(self):
            self.gate.refused += 1
            self.end()
            return
        self.client.pause_reading()            # nothing is read until the pipe is open
        self.client.set_write_buffer_limits(high=PIPE_BUFFER_BYTES)
        self.opening = self.gate.open_pipe(self)

    def piped(self, inner: asyncio.Transport) -> None:
        """The inner end is open: the client is read from now on."""
        self.opening = None
        if self.client is None:                # ended meanwhile
            inner.abort()
            return
        self.inner = inner
        inner.set_write_buffer_limits(high=PIPE_BUFFER_BYTES)
        self.client.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.spoke = True
        if self.inner is not None:
            self.inner.write(data)

    def eof_received(self) -> bool | None:
        if self.inner is not None and self.inner.can_write_eof():
            self.inner.write_eof()
        return True                            # half-open: grpc may still answer

    def pause_writing(self) -> None:           # the client takes nothing: stop reading grpc
        if self.inner is not None:
            self.inner.pause_reading()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.end()

    def end(self) -> None:
        """Abort both ends (idempotent) and give the place back."""
        if self.opening is not None:
            self.opening.cancel()
            self.opening = None
        if self.client is not None:
            self.gate.per_address[self.address] -= 1
            if not self.gate.per_address[self.address]:
                del self.gate.per_address[self.address]
        self.gate.roster.leave(self)
        self.gate.by_port.pop(self.inner_port(), None)
        for transport in (self.client, self.inner):
            if transport is not None:
                transport.abort()
        self.client = self.inner = None

    def evict(self) -> None:
        self.gate.evicted += 1
        self.end()

    def inner_port(self) -> int | None:
        name = self.inner.get_extra_info("sockname") if self.inner is not None else None
        return name[1] if name else None

    def seated(self, seat: Seat) -> None:
        self.seats.add(seat)

    def unseated(self, seat: Seat) -> None:
        """A call of this connection ended: its work, if any, counts as the connection's."""
        self.seats.discard(seat)
        rank = seat.rank()
        if rank is None or rank[0]:
            self.worked, self.moved = True, self.gate.clock.now()

    def rank(self) -> Rank:
        ranks = [seat.rank() for seat in self.seats]
        if None in ranks:
            return None
        worked = self.worked or any(r[0] for r in ranks if r is not None)
        moved = max([self.moved, *(r[1] for r in ranks if r is not None and r[0])])
        since, held = self.gate.clock.now() - moved, self.gate.per_address[self.address]
        fair = held * len(self.gate.per_address) <= self.gate.roster.limit
        if since < (EVICT_GRACE_SECONDS if worked else SETTLE_SECONDS if fair else 0.0):
            return None
        return -held, worked, self.spoke, moved


class _InnerEnd(asyncio.Protocol):
    """The door's grpc server's end of one pipe: what it writes goes to the client."""

    def __init__(self, outer: GatedConnection):
        self.outer = outer

    def data_received(self, data: bytes) -> None:
        if self.outer.client is not None:
            self.outer.client.write(data)

    def pause_writing(self) -> None:           # grpc takes nothing: stop reading the client
        if self.outer.client is not None:
            self.outer.client.pause_reading()

    def resume_writing(self) -> None:
        if self.outer.client is not None:
            self.outer.client.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.outer.end()


class ConnectionGate:
    """The gRPC door's public port: at most ``limit`` connections (:class:`Roster` of
    :class:`GatedConnection`; one past it with none to take is closed at once, as grpcio
    closed one), each piped to the door's grpc server on ``LOOPBACK:inner_port``.

    Invariant: ``by_port`` maps the gate's local port of each open pipe to its connection,
    so a call's peer names the client connection it came on."""

    def __init__(self, host: str, port: int, inner_port: int, limit: int, clock: LoopClock):
        self.host, self.port, self.inner_port, self.clock = host, port, inner_port, clock
        self.roster = Roster(limit)
        self.by_port: dict[int | None, GatedConnection] = {}
        self.per_address: collections.Counter[str | None] = collections.Counter()
        self.refused = self.evicted = 0
        self.second, self.room_tries = 0, collections.Counter[str | None]()  # this second
        self.server: asyncio.Server | None = None
        self.opening: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.server = await asyncio.get_running_loop().create_server(
            lambda: GatedConnection(self), self.host, self.port, reuse_port=False,
            backlog=ACCEPT_BACKLOG)

    def admit(self, newcomer: GatedConnection) -> bool:
        """Whether ``newcomer`` gets a place: below the cap, yes; at it, only while the
        gate has made room fewer than ``ROOM_PER_SECOND`` times this second (fewer than
        ``ADDRESS_ROOM_PER_SECOND`` for its address) and a place ranks to be taken. Ranking
        scans every connection (~1 ms at 512), so a connect flood at the cap costs the
        doors' loop at most that rate of scans; past it a newcomer is closed at once."""
        if len(self.roster.seats) < self.roster.limit:
            return self.roster.enter(newcomer)
        now = int(self.clock.now())
        if now != self.second:
            self.second, self.room_tries = now, collections.Counter()
        if (self.room_tries.total() >= ROOM_PER_SECOND
                or self.room_tries[newcomer.address] >= ADDRESS_ROOM_PER_SECOND):
            return False
        self.room_tries[newcomer.address] += 1
        return self.roster.enter(newcomer)

    def open_pipe(self, outer: GatedConnection) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(self._open(outer))
        self.opening.add(task)
        task.add_done_callback(self.opening.discard)
        return task

    async def _open(self, outer: GatedConnection) -> None:
        try:
            inner, _ = await asyncio.get_running_loop().create_connection(
                lambda: _InnerEnd(outer), LOOPBACK, self.inner_port)
        except OSError:
            outer.opening = None
            outer.end()
            return
        outer.piped(inner)                    # type: ignore[arg-type]
        if outer.inner is not None:
            self.by_port[outer.inner_port()] = outer

    def connection(self, peer: str) -> GatedConnection | None:
        """The client connection a call came on, from the call's peer (grpc's
        ``ipv4:127.0.0.1:PORT``); None for one that did not come through the gate."""
        host_port = peer.removeprefix("ipv4:")
        host, _, port = host_port.rpartition(":")
        return self.by_port.get(int(port)) if host == LOOPBACK and port.isdigit() else None

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.opening):
            task.cancel()
        for connection in list(self.roster.seats):
            connection.end()
        if self.server is not None:
            await self.server.wait_closed()

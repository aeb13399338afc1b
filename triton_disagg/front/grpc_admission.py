"""Which connections get into the public gRPC door (:mod:`.public_door`): each accepted here
and piped byte for byte to the door's grpc server on a loopback port of its own
(:class:`ConnectionGate`), capped as its calls are (:mod:`.call_seats`): a newcomer past
the cap takes the place of the one that does least, so places held doing nothing never
keep a working client out.

Why a gate: grpcio caps connections (``grpc.max_allowed_incoming_connections``) but cannot
end an open one to make room, so clients that reconnect as each silent connection is closed,
or start an empty call every few seconds, held every place (scaled to 8 connections, a
victim failed 15 of 15 tries). The gate sees every connection, and the door tells it which
of a connection's calls work: a call's peer is the gate's end of that connection's pipe
(``ipv4:127.0.0.1:PORT``), so :meth:`ConnectionGate.connection` finds it."""

from __future__ import annotations

import asyncio
import itertools

from triton_disagg.front.call_seats import EVICT_GRACE_SECONDS, MAX_DETACHED, Rank, Roster, Seat
from triton_disagg.front.door_guards import LoopClock
from triton_disagg.triton.endpoints import LOOPBACK

SETTLE_SECONDS = 0.2        # nor a connection this new: time to say its first bytes
PIPE_BUFFER_BYTES = 256 * 1024   # bytes one side of a pipe buffers before the other pauses
HANDSHAKE_SECONDS = 5.0     # closed by then: one that sent nothing (the gate), or no HTTP/2 (grpc)
OWN_WINDOW = 8              # an address's connections one look at it ranks
OWN_LOOKS = 8               # looks for room in one address, each past the last one's
ACCEPT_BACKLOG = 128        # connections the kernel queues (one accept callback takes them)


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
        self.detached = 0                      # its calls ended for room, still writing
        self.early = b""                       # its first bytes, until the pipe is open
        self.silence: asyncio.TimerHandle | None = None   # ends it if it never speaks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client = transport                # type: ignore[assignment]
        self.address = (transport.get_extra_info("peername") or ("?",))[0]
        self.gate.by_address.setdefault(self.address, {})[self] = None
        if not self.gate.admit(self):
            self.gate.refused += 1
            self.end()
            return
        self.client.set_write_buffer_limits(high=PIPE_BUFFER_BYTES)
        self.silence = asyncio.get_running_loop().call_later(HANDSHAKE_SECONDS, self.end)

    def data_received(self, data: bytes) -> None:
        """The first bytes open the pipe (a connection that never speaks costs no inner
        connection: a flood of silent ones is an accept and a close each); the client is
        not read again until it is open."""
        if self.inner is not None:
            self.inner.write(data)
        elif not self.spoke:
            self.spoke, self.early = True, data
            self.gate.unsilent(self)
            self.silence.cancel()
            self.client.pause_reading()
            self.opening = self.gate.open_pipe(self)

    def piped(self, inner: asyncio.Transport) -> None:
        """The inner end is open: what the client said goes through, and it is read on."""
        self.opening = None
        if self.client is None:                # ended meanwhile
            inner.abort()
            return
        self.inner = inner
        inner.set_write_buffer_limits(high=PIPE_BUFFER_BYTES)
        inner.write(self.early)
        self.early = b""
        self.client.resume_reading()

    def eof_received(self) -> bool | None:
        if self.inner is None:                 # nothing said: nothing to answer
            self.end()
            return False
        if self.inner.can_write_eof():
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
        if self.silence is not None:
            self.silence.cancel()
        if self.opening is not None:
            self.opening.cancel()
            self.opening = None
        self.gate.forget(self)
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
        seat.connection = self

    def detach(self) -> None:
        """A call of this connection was ended for room mid-answer (:class:`Seat`); past
        ``MAX_DETACHED`` such at once, the connection is ended (grpcio counts each against
        its call cap until its answer is taken)."""
        self.detached += 1
        if self.detached > MAX_DETACHED:
            self.end()

    def unseated(self, seat: Seat) -> None:
        """A call of this connection ended: its work, if any, counts as the connection's."""
        self.seats.discard(seat)
        self.detached -= seat.detached
        rank = seat.rank()
        if rank is None or rank[0]:
            self.worked, self.moved = True, self.gate.clock.now()

    def rank(self) -> Rank:
        ranks = [seat.rank() for seat in self.seats]
        if None in ranks:
            return None
        worked = self.worked or any(r[0] for r in ranks if r is not None)
        moved = max([self.moved, *(r[1] for r in ranks if r is not None and r[0])])
        since, over = self.gate.clock.now() - moved, self.gate.over_share(self.address)
        if since < (EVICT_GRACE_SECONDS if worked else 0.0 if over else SETTLE_SECONDS):
            return None
        return -self.gate.held(self.address), worked, self.spoke, moved


class _InnerEnd(asyncio.Protocol):
    """The door's grpc server's end of one pipe: what it writes goes to the client (paused
    while grpc takes nothing of the client's)."""

    def __init__(self, outer: GatedConnection):
        self.outer = outer

    def data_received(self, data: bytes) -> None:
        if self.outer.client is not None:
            self.outer.client.write(data)

    def pause_writing(self) -> None:
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

    Invariants: ``by_port`` maps the gate's local port of each open pipe to its connection,
    so a call's peer names the client connection it came on; ``by_address`` lists per
    address every connection that holds a place or is being admitted (a newcomer counts for
    its address while :meth:`admit` decides), so an address's length is what it holds;
    oldest first, but for those :meth:`_idlest` found it could not take."""

    def __init__(self, host: str, port: int, inner_port: int, limit: int, clock: LoopClock):
        self.host, self.port, self.inner_port, self.clock = host, port, inner_port, clock
        self.roster = Roster(limit)
        self.by_port: dict[int | None, GatedConnection] = {}
        # per address, its connections that have sent nothing yet, oldest first
        self.silent: dict[str | None, dict[GatedConnection, None]] = {}
        self.by_address: dict[str | None, dict[GatedConnection, None]] = {}
        self.refused = self.evicted = 0
        self.server: asyncio.Server | None = None
        self.opening: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.server = await asyncio.get_running_loop().create_server(
            lambda: GatedConnection(self), self.host, self.port, reuse_port=False,
            backlog=ACCEPT_BACKLOG)

    def admit(self, newcomer: GatedConnection) -> bool:
        """Whether ``newcomer`` gets a place (:attr:`roster`). At the cap, a newcomer whose
        address holds more than its share takes a place of its own address
        (:meth:`_own_room`), else an idle place of an address holding more than its own
        (:meth:`_room_from_busier`), or is closed: clients of one address take each other's
        places, never those of an address holding fewer. Any other newcomer takes room from
        the busiest address (:meth:`_room_from_busiest`), else the first place of a ranking
        of every connection (:meth:`Roster.enter`, a ranking used for ``RANKING_SECONDS``)."""
        roster = self.roster
        if len(roster.seats) >= roster.limit:
            if self.over_share(newcomer.address):
                if not (self._own_room(newcomer) or self._room_from_busier(newcomer)):
                    return False
            else:
                self._room_from_busiest(newcomer)
        if not roster.enter(newcomer):
            return False
        self.silent.setdefault(newcomer.address, {})[newcomer] = None
        return True

    def _own_room(self, newcomer: GatedConnection) -> bool:
        """Whether room was made for a newcomer of an address over its share, from that
        address: its oldest connection that has sent nothing (no ranking; a silent
        connection has no pipe yet, so a flood of silent reconnects costs an accept and a
        close each), else the one :meth:`_idlest` finds."""
        quiet = self.silent.get(newcomer.address)
        if quiet and self._take(next(iter(quiet))):
            return True
        idlest = self._idlest(newcomer.address, newcomer)
        return idlest is not None and self._take(idlest)

    def _room_from_busier(self, newcomer: GatedConnection) -> bool:
        """Whether room was made for a newcomer over its share from an address holding more
        than the newcomer's (a newcomer included; so none drops below it): the first of the
        roster's ranking (the address holding the most first) when its address holds more.
        So an address holding idle places never caps a working one that holds fewer, whoever
        holds the most (rev27r R-1, rev27s S-1), but for a ranking's ``RANKING_SECONDS``: an
        address whose count fell since the ranking stops the search until the next one."""
        mine = self.held(newcomer.address)
        taken = self.roster.first_where(lambda place: self.held(place.address) > mine)
        return taken is not None and self._take(taken)

    def _room_from_busiest(self, newcomer: GatedConnection) -> None:
        """Room for a newcomer within its address's share, from another address: the oldest
        silent connection of the address holding the most of those, else the one
        :meth:`_idlest` finds of the address holding the most when that is over its share
        (so an address flooding its own places never spends the ranking that others'
        newcomers need), else none (a ranking decides)."""
        if self.silent:
            address = max(self.silent, key=self.held)
            if self._take(next(iter(self.silent[address]))):
                return
        busiest = max(self.by_address, key=self.held)
        if self.over_share(busiest) and (idlest := self._idlest(busiest, newcomer)) is not None:
            self._take(idlest)

    def held(self, address: str | None) -> int:
        """How many connections ``address`` holds (a newcomer being admitted included)."""
        return len(self.by_address.get(address, ()))

    def over_share(self, address: str | None) -> bool:
        """Whether ``address`` holds more than its share: more than one connection (one is
        every address's due, however many there are), and more than the cap divided among
        the addresses holding any."""
        held = self.held(address)
        return held > 1 and held * len(self.by_address) > self.roster.limit

    def _idlest(self, address: str | None, newcomer: GatedConnection) -> GatedConnection | None:
        """The connection of ``address`` (``newcomer`` aside) to take, or None: a bounded
        look, not a ranking of every connection. A look ranks the first ``OWN_WINDOW`` of
        the address's list and takes the first; those it finds that may not be taken
        (working, or within a grace) go to the back, so the next look sees others; with
        none to take, it looks again, ``OWN_LOOKS`` times at most (8 connections working
        every second had blocked a single look)."""
        mine = self.by_address.get(address, {})
        for _ in range(min(OWN_LOOKS, -(-len(mine) // OWN_WINDOW))):    # ceil(len / window)
            ranked = []
            for i, connection in enumerate(list(itertools.islice(mine, OWN_WINDOW))):
                if connection is newcomer:
                    continue
                if (rank := connection.rank()) is None:
                    mine[connection] = mine.pop(connection)          # to the back
                else:
                    ranked.append((rank, i, connection))
            if ranked:
                return min(ranked)[2]
        return None

    def _take(self, oldest: GatedConnection) -> bool:
        """End ``oldest`` for room unless it is settling (so are those after it): whether
        it was ended."""
        if oldest.rank() is None:
            return False
        self.roster.seats.discard(oldest)
        oldest.evict()
        return True

    def forget(self, connection: GatedConnection) -> None:
        """``connection`` ended: out of the gate's lists by address."""
        _drop(self.silent, connection)
        _drop(self.by_address, connection)

    def unsilent(self, connection: GatedConnection) -> None:
        """``connection`` spoke: no longer among the silent."""
        _drop(self.silent, connection)

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


def _drop(lists: dict[str | None, dict[GatedConnection, None]],
          connection: GatedConnection) -> None:
    """``connection`` out of its address's list in ``lists`` (an emptied list too)."""
    mine = lists.get(connection.address)
    if mine is not None:
        mine.pop(connection, None)
        if not mine:
            del lists[connection.address]

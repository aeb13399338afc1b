"""The public gRPC door's call cap (:mod:`.public_door`; its connections,
:mod:`.grpc_admission`, are capped the same way): each call holds a :class:`Seat` of a
:class:`Roster`; a newcomer past the cap takes the place of the one that does least, ranked
by the inference it answered (:func:`worked_rank`), so places held doing nothing never keep
a working client out."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from triton_disagg.front.grpc_admission import GatedConnection

EVICT_GRACE_SECONDS = 2.0   # a place whose work moved this recently is not taken for room
RANKING_SECONDS = 0.1       # how long a roster's ranking of its places is used again
MAX_DETACHED = 4            # a connection's calls ended for room mid-answer, still writing
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
    is work, so cheap calls protect neither the seat nor its connection.

    Ended for room while it writes an answer (``writing``), the call is not cancelled: it is
    ``detached``, all its other work stopped (:attr:`stop_work`), its write finishing in the
    client's time (a client that reads slowly but in time keeps its answer and its
    connection); one that the client does not take in time marks ``unread``, and
    :class:`.public_door.GrpcDoor` ends its connection. A connection with more than
    ``MAX_DETACHED`` such calls at once is ended at once."""

    def __init__(self, entered: float):
        self.task = asyncio.current_task()
        self.entered = entered
        self.rank: Callable[[], Rank] = self.unworked
        self.evicted = self.writing = self.detached = False
        self.unread = False        # its client did not take an answer of it in time
        self.connection: GatedConnection | None = None
        # what a detached call stops: all its work but the write under way (a stream's
        # reading of the client and its calls to tritonserver; a unary call has none)
        self.stop_work: Callable[[], None] = lambda: None

    def unworked(self) -> Rank:
        return False, self.entered

    def evict(self) -> None:
        self.evicted = True
        if self.writing:
            self.detached = True
            self.stop_work()
            if self.connection is not None:
                self.connection.detach()
        elif self.task is not None:
            self.task.cancel()


class Roster:
    """At most ``limit`` places (anything with ``rank()`` and ``evict()``): one past it takes
    the place that ranks first (``rank()``: a place that never did work, a refusal's or
    nothing, then the one whose work moved longest ago), which is evicted, or, with none to
    take (every rank None), is refused. So places held doing nothing (a call that never
    sends, one that sends refusals and reads nothing, a silent connection) never keep a
    working one out: 64 such calls from one connection had refused every other client until
    they left.

    Ranking asks every place (~1 ms at 512): a ranking is used again for
    ``RANKING_SECONDS`` (each place taken from it asked again first: one that began to
    work, or left, is passed over), so a flood of newcomers at the cap costs a ranking a
    tenth of a second, not one each (800 connects a second had stalled the doors' loop)."""

    def __init__(self, limit: int):
        self.limit, self.seats = limit, set()
        self.ranking: list = []                # evictable places, the first to take last
        self.ranked_at = -RANKING_SECONDS

    def enter(self, seat) -> bool:
        if len(self.seats) >= self.limit:
            first = self.first_where(_anyone)
            if first is None:
                return False
            self.seats.discard(first)
            first.evict()
        self.seats.add(seat)
        return True

    def leave(self, seat) -> None:
        self.seats.discard(seat)

    def first_where(self, wanted: Callable[[object], bool]):
        """The place to take if ``wanted(place)``, else None: the first of the ranking still
        here and still evictable (a ranking older than ``RANKING_SECONDS`` made afresh
        first), taken out of the ranking only when wanted (one not wanted stays first for
        the next caller)."""
        if time.monotonic() - self.ranked_at >= RANKING_SECONDS:
            ranked = [(rank, i, taken) for i, taken in enumerate(self.seats)
                      if (rank := taken.rank()) is not None]
            ranked.sort(reverse=True)              # the first to take at the end
            self.ranking, self.ranked_at = ranked, time.monotonic()
        while self.ranking:
            taken = self.ranking[-1][2]
            if taken not in self.seats or taken.rank() is None:
                self.ranking.pop()
            elif wanted(taken):
                return self.ranking.pop()[2]
            else:
                return None
        return None


def _anyone(_place) -> bool:
    return True

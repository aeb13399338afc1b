"""Reader loops that cannot die quietly: the loops that take frames from peers (the
orchestrator's token inbox, generation's stop inbox, the decode loop, a context's NIXL
notifications, generation's overlapped-transfer notifications).

- A frame a reader cannot use (not msgpack, wrong version, wrong type or length, a key
  that is not its request's, a request nobody waits for) is dropped and counted by the
  reader's :class:`DroppedFrames`: ``disagg_dropped_frames_total{reader, reason}``
  through the process's metrics (:func:`report_to`), and one log line per reader and
  reason at most every ``LOG_EVERY_SECONDS`` (saying how many were dropped since):
  WARNING, but INFO for ``unknown_request``, which a cancel makes in normal operation
  (events still on the way for a stream that ended).
- A reader loop that ends by an unexpected exception (a bug: a malformed frame is never
  one) calls its ``on_death``, by default :func:`fail_instance`: one CRITICAL line with
  the traceback, then the process exits with ``EXIT_READER_DIED``. A model instance is a
  Python-backend stub process, so ``serve`` sees the stub die and restarts the server
  (:mod:`triton_disagg.triton.stub_watch`); a reader that died silently would leave every
  later request of its instance to wait out ``stall_seconds`` and fail.

Invariant: one model instance per process (a stub), so one metrics observer per process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections import Counter
from typing import Callable, Optional, Protocol

MALFORMED = "malformed"              # not a message of the reader's schema
BAD_KEY = "bad_key"                  # a request's frame without the request's key
UNKNOWN_REQUEST = "unknown_request"  # for a request this reader does not hold (any more)
LOG_EVERY_SECONDS = 10.0             # per reader and reason
EXIT_READER_DIED = 70                # EX_SOFTWARE: the stub's exit status
_log = logging.getLogger(__name__)


class DroppedObserver(Protocol):
    def dropped_frame(self, reader: str, reason: str) -> None:
        """Count one dropped frame (:meth:`triton_disagg.triton.metrics.Metrics.dropped_frame`)."""


_observer: Optional[DroppedObserver] = None


def report_to(observer: Optional[DroppedObserver]) -> None:
    """Send this process's dropped-frame counts to ``observer`` (a model's ``Metrics``, in its
    ``initialize``); None stops it (``finalize``)."""
    global _observer
    _observer = observer


class DroppedFrames:
    """What one reader dropped: ``counts`` by reason, the metric, a rate-limited log."""

    def __init__(self, reader: str, clock: Callable[[], float] = time.monotonic):
        self.reader, self.clock = reader, clock
        self.counts: Counter[str] = Counter()
        self._unlogged: Counter[str] = Counter()      # dropped since the reason's last line
        self._logged: dict[str, float] = {}           # reason -> when its last line went out

    def drop(self, reason: str, detail: str) -> None:
        """Count a dropped frame; log it unless this reason was logged in the last
        ``LOG_EVERY_SECONDS`` (then the next line says how many were dropped meanwhile)."""
        self.counts[reason] += 1
        self._unlogged[reason] += 1
        if _observer is not None:
            _observer.dropped_frame(self.reader, reason)
        now = self.clock()
        last = self._logged.get(reason)
        if last is not None and now - last < LOG_EVERY_SECONDS:
            return
        self._logged[reason], count = now, self._unlogged.pop(reason)
        _log.log(logging.INFO if reason == UNKNOWN_REQUEST else logging.WARNING,
                 "%s dropped %d frame(s) (%s) since its last such line; latest: %s",
                 self.reader, count, reason, detail[:300])


OnDeath = Callable[[str, BaseException], None]


def fail_instance(reader: str, exc: BaseException) -> None:
    """A reader died: say so with the traceback, then end this model instance's process
    (``os._exit``: nothing of a broken instance runs on, and no Python teardown waits)."""
    _log.critical("%s died (%s: %s); this model instance cannot serve without it, so its "
                  "process exits and serve restarts the server", reader, type(exc).__name__,
                  exc, exc_info=(type(exc), exc, exc.__traceback__))
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_READER_DIED)


def guarded(reader: str, loop: Callable[[], None], on_death: OnDeath = fail_instance
            ) -> Callable[[], None]:
    """A thread target that runs ``loop`` and calls ``on_death`` if it raises."""
    def run() -> None:
        try:
            loop()
        except BaseException as exc:  # noqa: BLE001 - a dead reader takes its instance down
            on_death(reader, exc)
    return run


def watch_task(reader: str, task: asyncio.Task, on_death: OnDeath = fail_instance) -> None:
    """Call ``on_death`` when ``task`` (a reader that runs until cancelled) ends by an
    exception."""
    def ended(done: asyncio.Task) -> None:
        if not done.cancelled() and done.exception() is not None:
            on_death(reader, done.exception())
    task.add_done_callback(ended)

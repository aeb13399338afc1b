"""A task run now and then every few seconds on a thread of its own: a server's heartbeat,
the scheduler's poll of etcd."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

_log = logging.getLogger(__name__)
LOG_EVERY_SECONDS = 60.0      # while a tick keeps failing, one line per this many seconds


class Periodic:
    """:meth:`start` runs ``tick`` once on the caller's thread, then every ``seconds`` on a
    daemon thread named ``name``; once :meth:`stop` returns, ``tick`` runs no more.

    Invariant: an exception out of ``tick`` never ends the schedule: it is logged (with its
    traceback when a failing streak starts, then at most once per ``LOG_EVERY_SECONDS`` with
    the count, and once when a tick succeeds again) and the next tick runs on time."""

    def __init__(self, tick: Callable[[], None], seconds: float, name: str):
        self.tick, self.seconds, self.name = tick, seconds, name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.failures = 0                 # consecutive ticks that raised
        self._logged_at = 0.0             # time.monotonic() of the last failure logged

    def start(self) -> None:
        self._guarded()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.seconds):
            self._guarded()

    def _guarded(self) -> None:
        try:
            self.tick()
        except Exception:
            self.failures += 1
            now = time.monotonic()
            if self.failures == 1 or now - self._logged_at >= LOG_EVERY_SECONDS:
                self._logged_at = now
                _log.exception("%s: a tick failed (%d in a row); trying again every %.2g s",
                               self.name, self.failures, self.seconds)
            return
        if self.failures:
            _log.warning("%s: a tick succeeded after %d failed", self.name, self.failures)
        self.failures = 0

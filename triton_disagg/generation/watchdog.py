"""A watchdog for a worker loop: when work is live and the loop has not come round for
``stuck_seconds``, it logs every thread's stack and calls ``on_stuck`` (once per stall).

Invariants: the watchdog only reads the heartbeat and calls ``is_busy`` / ``on_stuck``
from its own thread, which those callables must allow; a beat after a stall re-arms it.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
from typing import Callable

_log = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, name: str, stuck_seconds: float, is_busy: Callable[[], bool],
                 on_stuck: Callable[[], None]):
        self.name, self.stuck_seconds = name, stuck_seconds
        self.is_busy, self.on_stuck = is_busy, on_stuck
        self.last = time.monotonic()
        self.fired = False
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        self.thread.start()

    def beat(self) -> None:
        self.last = time.monotonic()
        self.fired = False

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5.0)

    def _watch(self) -> None:
        while not self.stopped.wait(min(1.0, self.stuck_seconds / 4)):
            silent = time.monotonic() - self.last
            if self.fired or silent < self.stuck_seconds or not self.is_busy():
                continue
            self.fired = True
            _log.error("%s: no progress for %.1f s with work live; every thread's stack follows",
                       self.name, silent)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            try:
                self.on_stuck()
            except Exception:  # noqa: BLE001 - the watchdog outlives a failing rescue
                _log.exception("%s: failing the stuck loop's requests failed", self.name)

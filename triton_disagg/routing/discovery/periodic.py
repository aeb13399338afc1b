"""A task run now and then every few seconds on a thread of its own: a server's heartbeat,
the scheduler's poll of etcd."""

from __future__ import annotations

import threading
from typing import Callable


class Periodic:
    """:meth:`start` runs ``tick`` once on the caller's thread, then every ``seconds`` on a
    daemon thread named ``name``; once :meth:`stop` returns, ``tick`` runs no more."""

    def __init__(self, tick: Callable[[], None], seconds: float, name: str):
        self.tick, self.seconds = tick, seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.tick()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.seconds):
            self.tick()

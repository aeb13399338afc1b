"""The generation instance's one KV fetch thread: started fetches run here, in order, while
the decode loop goes on stepping.

:meth:`FetchWorker.submit` queues a blocking fetch (a callable taking its deadline) and
returns a :class:`PendingTransfer` at once; the decode loop polls it between steps
(:meth:`~triton_disagg.kv.connector.Transfer.poll`: a lock-free look at an Event). One
thread per instance, not one per request: fetches into one pool run one at a time anyway
(they share the NIXL scratch and the staging reader), and a second thread would only add
GIL contention. The thread lowers its own priority (``FETCH_NICE``) so that, on the core
it shares with the decode loop, the loop's step wins.

Deadlines: each fetch gets ``deadline = the time it starts running + timeout_s`` and must
honour it itself (NIXL cancels its READ, a staging copy is bounded). The clock starts when
the fetch runs, not when it was queued: a fetch queued behind a silent context host's
waits for that one's deadline, then runs, so the silent host fails only its own requests
(``timeout_s`` is well below the lease, so the KV queued behind it is still there), and the
loop never waits for any of them.

Invariant (the :class:`~triton_disagg.kv.connector.Transfer` one): the destination blocks
belong to the fetch until ``poll`` returned stats or raised; ``poll`` reports only what the
thread finished, so a caller freeing blocks after a failed poll never races a copy.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Callable, Optional

from triton_disagg.kv.connector import ConnectorError, ThreadTransfer, lower_thread_priority
from triton_disagg.kv.handle import TransferStats

FETCH_NICE = 5          # added to the fetch thread's niceness (Linux: per thread)

Fetch = Callable[[float], TransferStats]    # blocking; takes its deadline (time.monotonic())


class PendingTransfer(ThreadTransfer):
    """A fetch queued on a :class:`FetchWorker`; ``poll`` returns its stats (``seconds``:
    the copy, ``in_flight_seconds``: submit to done) once the thread finished it."""

    def __init__(self, fetch: Fetch, timeout_s: float):
        super().__init__()
        self.fetch, self.timeout_s = fetch, timeout_s
        self.started = time.monotonic()

    def run(self) -> None:
        """The worker thread's part: run the fetch and record how it ended."""
        try:
            stats = self.fetch(time.monotonic() + self.timeout_s)
        except BaseException as exc:  # noqa: BLE001 - reported to the poller, request fails
            self.end(None, exc)
        else:
            self.end(dataclasses.replace(
                stats, in_flight_seconds=time.monotonic() - self.started), None)


class FetchWorker:
    """One thread (started on the first submit) running :class:`PendingTransfer` s in
    submission order; ``name`` labels it."""

    def __init__(self, name: str, nice: int = FETCH_NICE):
        self.name, self.nice = name, nice
        self._jobs: queue.SimpleQueue[Optional[PendingTransfer]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def submit(self, fetch: Fetch, timeout_s: float, what: str) -> PendingTransfer:
        """Queue ``fetch``, to run with a deadline ``timeout_s`` after it starts; never
        blocks."""
        job = PendingTransfer(fetch, timeout_s)
        with self._lock:
            if self._closed:
                raise ConnectorError(f"{what}: this KV connector is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self.name}-fetch",
                                                daemon=True)
                self._thread.start()
            self._jobs.put(job)
        return job

    def _run(self) -> None:
        lower_thread_priority(self.nice, self.name)
        while (job := self._jobs.get()) is not None:
            job.run()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop taking fetches; the thread finishes those queued, then ends (idempotent)."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout_s)

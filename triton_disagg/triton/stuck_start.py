"""A start that Triton abandoned: the stub finished, the server waits for it for ever.

Triton's Python backend waits for a stub's answer to ``initialize`` in one-second turns,
and gives the stub up when a turn passes without its health flag set: under CPU pressure
(a loaded host, a throttled container) the stub's health thread can miss one. Triton then
waits for that stub to exit (``StubLauncher::Launch`` -> ``WaitForStubProcess``) before it
logs the failure, but the stub does not know it was given up: its ``initialize`` finishes,
its threads run, and it never exits. The model never loads, nothing is logged, and the
server never turns ready. (Reproduced by throttling a stub to 1 ms of CPU a second for
6 s during its ``initialize``: ``tests/server/test_stuck_start.py``.)

:class:`StartWatch` reads the log as the server starts and finds that state: every stub of
a model has said it finished ``initialize``
(:func:`~triton_disagg.triton.stub_start.initialized_instance`), and ``STUCK_AFTER_SECONDS``
later Triton has still not reported the model loaded (it does within milliseconds of the
last instance's answer otherwise).
"""

from __future__ import annotations

import time
from typing import Callable

from triton_disagg.triton import server_log
from triton_disagg.triton.stub_start import initialized_instance
from triton_disagg.triton.stub_watch import Stub, model_instance_stubs

STUCK_AFTER_SECONDS = 30.0


def model_of(instance: str) -> str:
    """``generation_0_1`` -> ``generation`` (Triton's ``<model>_<group>_<index>``)."""
    return instance.rsplit("_", 2)[0]


class StartWatch:
    """Feed it every line of the log (:meth:`read`); :meth:`stuck` names the stubs of a
    model that Triton abandoned, if any. Invariant: a model Triton reported loaded, or one
    with a stub that has not finished ``initialize``, is never called stuck."""

    def __init__(self, server_pid: int, stuck_after: float = STUCK_AFTER_SECONDS,
                 stubs: Callable[[int], list[Stub]] = model_instance_stubs,
                 clock: Callable[[], float] = time.monotonic):
        self.server_pid, self.stuck_after = server_pid, stuck_after
        self._stubs, self._clock = stubs, clock
        self._initialized: dict[str, float] = {}     # instance -> when the log said so
        self._loaded: set[str] = set()

    def read(self, line: str) -> None:
        instance = initialized_instance(line)
        if instance is not None:
            self._initialized[instance] = self._clock()
        model = server_log.loaded_model(line)
        if model is not None:
            self._loaded.add(model)

    def stuck(self) -> list[Stub]:
        """The live stubs of the first model whose every stub finished ``initialize`` more
        than ``stuck_after`` seconds ago and that Triton has not loaded; [] when none."""
        by_model: dict[str, list[Stub]] = {}
        for stub in self._stubs(self.server_pid):
            by_model.setdefault(model_of(stub.instance), []).append(stub)
        now = self._clock()
        for model, stubs in sorted(by_model.items()):
            if model in self._loaded:
                continue
            finished = [self._initialized.get(s.instance) for s in stubs]
            if None not in finished and now - max(finished) > self.stuck_after:
                return stubs
        return []

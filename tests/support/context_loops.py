"""Driving a context :class:`~triton_disagg.context.prefill_loop.PrefillLoop` as its model's
``execute`` does, without Triton: each request's answer collected where a test can wait
for it."""

from __future__ import annotations

import threading

from triton_disagg.context.prefill_loop import PrefillLoop, Prompt, deadline_after
from triton_disagg.engine.sequence import EngineRequest

ANSWER_S = 30.0


class Collected:
    """One request's :class:`~triton_disagg.context.prefill_loop.Answer`: counts what is
    sent (exactly one answer is expected); ``cancel`` makes it say it was cancelled."""

    def __init__(self) -> None:
        self.results: list = []
        self.cancel = False
        self.done = threading.Event()

    def send(self, result) -> None:
        self.results.append(result)
        self.done.set()

    def cancelled(self) -> bool:
        return self.cancel

    def result(self, timeout: float = ANSWER_S):
        assert self.done.wait(timeout), "the context loop never answered"
        return self.results[0]


def submit(loop: PrefillLoop, batch: list[tuple[str, EngineRequest]],
           listeners: list[bytes] | None = None, wait_seconds: float = 0.0) -> list[Collected]:
    """Hand ``batch`` over as one ``execute`` would (one submission); their answers."""
    answers = [Collected() for _ in batch]
    listeners = listeners or [b""] * len(batch)
    loop.submit([Prompt(rid, request, answer, deadline_after(wait_seconds), listener)
                 for (rid, request), answer, listener in zip(batch, answers, listeners)])
    return answers


def prefill(loop: PrefillLoop, batch: list[tuple[str, EngineRequest]],
            listeners: list[bytes] | None = None) -> list:
    """Each request's answer (outputs or error), once all came."""
    return [answer.result() for answer in submit(loop, batch, listeners)]

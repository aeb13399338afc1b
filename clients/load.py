"""Open-loop load on a running server: requests sent at Poisson arrival times over gRPC
(the ensemble, :func:`run_load`) or over the HTTP front's OpenAI API (:func:`run_openai_load`).

Open loop means a request is sent at its arrival time whether or not earlier
ones have finished, so an overloaded server shows up as growing TTFT (queueing)
rather than as a slower sender. ``rate=inf`` sends every request at once (the
saturation burst); ``rate=0`` sends them one after another, each when the
previous one has finished (the unloaded latency).

Invariants: :func:`run_load` returns one :class:`Outcome` per request, in
request order; a request that errs, or has not finished ``deadline`` seconds
after the first send, has ``error`` set and counts as failed; every request
uses its own stream of one shared ``tritonclient.grpc.aio`` client (or its own request on
one shared ``aiohttp`` session).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Sequence

from triton_disagg.clients.stream import (GenerateRequest, Measurement, grpc_generate,
                                          openai_generate_async)

Send = Callable[[GenerateRequest], Awaitable[Measurement]]


@dataclass
class Outcome:
    request: GenerateRequest
    measurement: Measurement | None = None
    error: str | None = None


@dataclass
class LoadRun:
    rate: float                  # asked requests/s (inf: burst, 0: one at a time)
    outcomes: list[Outcome]
    duration: float              # first send to last completion, seconds
    client_cpu: float | None = None   # CPU seconds this process spent sending and receiving


def arrival_times(n: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds after the start at which each of ``n`` requests is sent (Poisson process)."""
    if math.isinf(rate):
        return [0.0] * n
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


@contextlib.asynccontextmanager
async def _grpc_sender(url: str, model: str) -> AsyncIterator[Send]:
    import tritonclient.grpc.aio as aio

    async with aio.InferenceServerClient(url) as client:
        yield lambda request: grpc_generate(client, request, model)


@contextlib.asynccontextmanager
async def _openai_sender(front: str, model: str) -> AsyncIterator[Send]:
    import aiohttp

    limits = aiohttp.TCPConnector(limit=0)          # no cap on concurrent requests
    async with aiohttp.ClientSession(connector=limits,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        yield lambda request: openai_generate_async(session, front, request, model)


async def _send_all(sender, requests: Sequence[GenerateRequest], rate: float, seed: int,
                    deadline: float) -> LoadRun:
    outcomes = [Outcome(r) for r in requests]
    async with sender as send:
        async def one(outcome: Outcome) -> None:
            try:
                outcome.measurement = await send(outcome.request)
            except Exception as exc:  # noqa: BLE001 - a failed request is data, not a crash
                outcome.error = f"{type(exc).__name__}: {exc}"

        start, cpu = time.perf_counter(), time.process_time()
        if rate == 0:
            for outcome in outcomes:
                try:
                    await asyncio.wait_for(one(outcome), start + deadline - time.perf_counter())
                except TimeoutError:
                    break
        else:
            tasks = []
            times = arrival_times(len(outcomes), rate, random.Random(seed))
            for outcome, at in zip(outcomes, times, strict=True):
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                tasks.append(asyncio.create_task(one(outcome)))
            left = start + deadline - time.perf_counter()
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, left))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for outcome in outcomes:
            if outcome.measurement is None and outcome.error is None:
                outcome.error = f"not finished within {deadline:.0f} s"
        return LoadRun(rate, outcomes, time.perf_counter() - start, time.process_time() - cpu)


def run_load(url: str, requests: Sequence[GenerateRequest], rate: float, seed: int = 0,
             deadline: float = 300.0, model: str = "ensemble") -> LoadRun:
    """Send ``requests`` to the gRPC endpoint ``url`` at ``rate`` (see the module docstring)."""
    return asyncio.run(_send_all(_grpc_sender(url, model), requests, rate, seed, deadline))


def run_openai_load(front: str, model: str, requests: Sequence[GenerateRequest], rate: float,
                    seed: int = 0, deadline: float = 300.0) -> LoadRun:
    """Send ``requests`` to the HTTP front at ``front`` (``/v1/completions``, streamed) at
    ``rate`` (see the module docstring)."""
    return asyncio.run(_send_all(_openai_sender(front, model), requests, rate, seed, deadline))

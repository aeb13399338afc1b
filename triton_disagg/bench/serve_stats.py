"""Figures of a load run: latency percentiles, throughput, SLO attainment, goodput.

Definitions (client-measured, seconds internally):

- TTFT: send to first response; TPOT (time per output token): per request,
  (last - first response) / (output tokens - 1); ITL (inter-token latency):
  every gap between consecutive tokens (a response carrying k tokens adds its gap
  and k - 1 zeros), pooled over the run's requests;
- throughput: completed requests, and their output tokens, per second of the
  run (first send to last completion);
- SLO attainment: share of *all* sent requests that finished without error
  with TTFT <= ``slo.ttft`` and TPOT <= ``slo.tpot`` (a one-token reply has
  no TPOT and meets that half);
- goodput: the highest swept rate whose attainment is >= ``threshold``
  (:data:`GOODPUT_ATTAINMENT`, 0.9); a rate below it misses the SLO;
- client cores: CPU seconds the load generator spent per second of the run
  (it shares the host's cores with the server).

Invariant: percentiles are None when there is no value to take them of.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from triton_disagg.clients.load import LoadRun
from triton_disagg.clients.stream import Measurement

GOODPUT_ATTAINMENT = 0.9     # a swept rate meets the SLO when this share of requests did


@dataclass(frozen=True)
class SLO:
    ttft: float                  # seconds
    tpot: float                  # seconds

    def met_by(self, m: Measurement) -> bool:
        tpot = m.tpot
        return m.ttft is not None and m.ttft <= self.ttft and (tpot is None or tpot <= self.tpot)


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Iterable[float]) -> "Percentiles | None":
        arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
        if not arr.size:
            return None
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])
        return cls(float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class Summary:
    mode: str                    # "disaggregated", "aggregated", "in-process"
    rate: float                  # asked requests/s (inf: burst, 0: one at a time)
    sent: int
    failed: int
    duration: float
    request_throughput: float    # completed requests / s
    token_throughput: float      # output tokens / s
    ttft: Percentiles | None
    tpot: Percentiles | None
    itl: Percentiles | None
    attainment: float            # 0..1
    client_cores: float | None = None   # the load generator's CPU seconds per second
    errors: tuple[str, ...] = ()  # distinct error messages (at most 3)


def summarize(mode: str, run: LoadRun, slo: SLO) -> Summary:
    done = [o.measurement for o in run.outcomes if o.error is None and o.measurement is not None]
    errors = sorted({o.error for o in run.outcomes if o.error is not None})
    duration = max(run.duration, 1e-9)
    sent = len(run.outcomes)
    return Summary(
        mode=mode, rate=run.rate, sent=sent, failed=sent - len(done), duration=run.duration,
        request_throughput=len(done) / duration,
        token_throughput=sum(m.output_tokens for m in done) / duration,
        ttft=Percentiles.of(m.ttft for m in done),
        tpot=Percentiles.of(m.tpot for m in done),
        itl=Percentiles.of(gap for m in done for gap in m.itl),
        attainment=sum(slo.met_by(m) for m in done) / sent if sent else 0.0,
        client_cores=None if run.client_cpu is None else run.client_cpu / duration,
        errors=tuple(errors[:3]))


def goodput(summaries: Sequence[Summary],
            threshold: float = GOODPUT_ATTAINMENT) -> float | None:
    """Highest finite, positive rate of ``summaries`` with attainment >= ``threshold``."""
    good = [s.rate for s in summaries
            if 0 < s.rate and not math.isinf(s.rate) and s.attainment >= threshold]
    return max(good) if good else None


def best_index(summaries: Sequence[Summary]) -> int:
    """Of runs of one request set: a serial set's (rate 0) with the lowest TTFT p50, any
    other's with the most output tokens/s. On a shared machine the best run is the one
    least disturbed by others; failed runs lose to complete ones."""
    def score(s: Summary) -> tuple:
        complete = s.failed == 0
        if s.rate == 0:
            return (complete, -(s.ttft.p50 if s.ttft is not None else math.inf))
        return (complete, s.token_throughput)
    return max(range(len(summaries)), key=lambda i: score(summaries[i]))

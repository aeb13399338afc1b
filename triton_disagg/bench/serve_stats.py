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

The rates a mode is swept at, and where its sweep stops (:class:`Sweep`), two kinds:

- stepped (the default): ``step, 2 x step, ...`` req/s up to ``cap``; a mode's sweep stops
  at the first rate where it misses its SLO (attainment below
  :data:`GOODPUT_ATTAINMENT`). Every mode is therefore
  swept until it misses, so the run as a whole goes on until every mode has missed (or
  the cap is reached) and each goodput is measured rather than a floor;
- explicit (``--rates``): every given rate in the given order, whatever the attainment.

Invariants: a mode gets at most ``len(rates)`` points, so a sweep always ends; the i-th
point of every mode is at the same rate, so the rows of two modes compare one to one as
far as both went; :func:`verdicts` says for every mode where it first missed, or that it
never did and its goodput is only a floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from triton_disagg.clients.load import LoadRun
from triton_disagg.clients.stream import Measurement
from triton_disagg.errors import UserError

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


# --- the sweep ---------------------------------------------------------------------------

def _misses(s: Summary) -> bool:
    return s.attainment < GOODPUT_ATTAINMENT


@dataclass(frozen=True)
class Sweep:
    rates: tuple[float, ...]      # requests/s, in sweep order
    until_miss: bool              # stop a mode's sweep after the first rate it misses

    @classmethod
    def stepped(cls, step: float, cap: float) -> "Sweep":
        """``step, 2 x step, ...`` up to and including ``cap``, each mode until it misses."""
        if not (step > 0 and math.isfinite(step)) or not (cap >= step and math.isfinite(cap)):
            raise UserError(f"--rate-step {step:g} and --max-rate {cap:g}: need 0 < step <= "
                            f"max rate")
        count = math.floor(cap / step + 1e-9)
        return cls(tuple(round(step * (i + 1), 6) for i in range(count)), True)

    @classmethod
    def explicit(cls, rates: Sequence[float]) -> "Sweep":
        return cls(tuple(rates), False)

    def describe(self) -> str:
        shown = ", ".join(f"{r:g}" for r in self.rates)
        if not self.until_miss:
            return f"{shown} req/s (--rates), every rate for every mode"
        if len(self.rates) > 3:
            shown = f"{self.rates[0]:g}, {self.rates[1]:g}, ... {self.rates[-1]:g}"
        return (f"{shown} req/s, each mode until it misses the SLO (below "
                f"{GOODPUT_ATTAINMENT:.0%} attainment) or reaches the cap of "
                f"{self.rates[-1]:g} req/s")

    def run(self, mode: str, measure: Callable[[int, float], Summary],
            say: Callable[[str], None]) -> list[Summary]:
        """``measure(i, rate)`` for each rate in turn (``i``: its index in :attr:`rates`),
        saying before each point and when the sweep stops; returns the points measured."""
        points: list[Summary] = []
        for i, rate in enumerate(self.rates):
            say(f"{mode}: rate {rate:g} req/s (point {i + 1} of at most {len(self.rates)})")
            points.append(measure(i, rate))
            if self.until_miss and _misses(points[-1]):
                say(f"{mode} missed its SLO at {rate:g} req/s "
                    f"({points[-1].attainment:.0%} attainment): its sweep stops here")
                return points
        if self.until_miss:
            say(f"{mode} met its SLO up to the cap of {self.rates[-1]:g} req/s: its goodput is "
                f"a floor (raise --max-rate)")
        return points


def verdicts(summaries: Sequence[Summary], modes: Sequence[str], sweep: Sweep) -> list[str]:
    """One markdown line per mode: the first swept rate where it missed its SLO, or that it
    met it at every swept rate (so its goodput is a floor)."""
    out = []
    for mode in modes:
        swept = [s for s in summaries if s.mode == mode and 0 < s.rate < math.inf]
        if not swept:
            continue
        missed = [s for s in swept if _misses(s)]
        if missed:
            first = missed[0]
            out.append(f"- **{mode}** missed the SLO first at {first.rate:g} req/s "
                       f"({first.attainment:.0%} attainment)"
                       + ("; its sweep stopped there." if sweep.until_miss else
                          f"; it missed at {len(missed)} of its {len(swept)} swept rates."))
        else:
            fix = ("the sweep's cap; raise --max-rate" if sweep.until_miss else
                   "sweep higher --rates, or leave --rates out to sweep until it misses")
            out.append(f"- **{mode}** met the SLO at every swept rate, up to "
                       f"{max(s.rate for s in swept):g} req/s: its goodput is a floor ({fix}).")
    return out

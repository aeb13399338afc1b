"""The request rates `bench serve` sweeps per mode, and where each mode's sweep stops.

Two kinds of :class:`Sweep`:

- stepped (the default): ``step, 2 x step, ...`` req/s up to ``cap``; a mode's sweep stops
  at the first rate where it misses its SLO (attainment below
  :data:`~triton_disagg.bench.serve_stats.GOODPUT_ATTAINMENT`). Every mode is therefore
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
from typing import Callable, Sequence

from triton_disagg.bench.serve_stats import GOODPUT_ATTAINMENT, Summary
from triton_disagg.errors import UserError


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

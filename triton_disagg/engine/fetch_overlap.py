"""How much of one KV fetch's time in flight the instance spent computing for others.

A fetch is *hidden* while the instance's engine runs prefill or decode passes for the
other sequences; time in flight with nothing to compute (an idle instance) hides nothing
but stalls nothing. The scheduler starts a :class:`ComputeOverlap` when it starts a fetch
and the engine reports every pass's compute interval to it (:meth:`ComputeOverlap.add`,
O(1)); when the fetch polls done, :meth:`ComputeOverlap.hidden_seconds` trims the part of
the last pass that ran after the fetch had ended.

Invariant: 0 <= ``hidden_seconds(in_flight)`` <= ``in_flight``, given that the fetch is
polled before every pass (so only the last pass added can reach past its end).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ComputeOverlap:
    """Compute time since ``began`` (the fetch's start; readings of one monotonic clock)."""

    began: float
    total: float = 0.0            # compute seconds after ``began``, last pass included
    last_start: float = 0.0       # the last pass added, clipped to start at ``began``
    last_end: float = 0.0

    def add(self, start: float, end: float) -> None:
        """The instance computed from ``start`` to ``end`` while the fetch was in flight."""
        start = max(start, self.began)
        if end > start:
            self.total += end - start
            self.last_start, self.last_end = start, end

    def hidden_seconds(self, in_flight_seconds: float) -> float:
        """Compute time inside [``began``, ``began + in_flight_seconds``]."""
        ended = self.began + in_flight_seconds
        after_end = max(0.0, self.last_end - max(ended, self.last_start))
        return min(max(0.0, self.total - after_end), in_flight_seconds)

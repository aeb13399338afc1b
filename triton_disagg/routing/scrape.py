"""Read a server's Prometheus metrics endpoint, and Triton's time per model between two reads.

:func:`scrape` (and :func:`parse_metrics`, from text) returns
``{metric name: {frozenset((label, value), ...): sample}}`` (histograms appear as their
``_bucket``/``_sum``/``_count`` series). Summing
over series whose labels include the given ones (:func:`total`) is how every
figure here is read, so a metric split over instances adds up.
"""

from __future__ import annotations

import re
import urllib.request
from collections import defaultdict
from dataclasses import dataclass

Samples = dict[str, dict[frozenset, float]]
_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")
_COMPUTE = ("compute_input", "compute_infer", "compute_output")


def parse_metrics(text: str) -> Samples:
    """Prometheus text exposition -> :data:`Samples` (lines that are no sample are skipped)."""
    out: Samples = defaultdict(dict)
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out[m.group(1)][labels] = float(m.group(3))
    return out


def scrape(url: str, timeout: float = 10.0) -> Samples:
    """``url``: http://host:port of the metrics endpoint."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as resp:
        return parse_metrics(resp.read().decode())


def total(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for k, v in samples.get(name, {}).items() if want <= k)


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """``{value of label: sample}`` of metric ``name`` (``"?"`` for a series without the
    label), e.g. each model instance's ``disagg_kv_blocks_used``."""
    return {dict(labels).get(label, "?"): value for labels, value in samples.get(name, {}).items()}


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


@dataclass(frozen=True)
class ModelTime:
    model: str
    executions: int
    queue_seconds: float          # summed over requests
    compute_seconds: float        # input + infer + output, summed over executions


def model_times(before: Samples, after: Samples) -> list[ModelTime]:
    """Triton's per-model counters between two scrapes, busiest model first; the ensemble
    is left out (its time overlaps its steps')."""
    models = {dict(k).get("model") for k in after.get("nv_inference_exec_count", {})}
    rows = []
    for model in sorted(m for m in models if m and m != "ensemble"):
        us = sum(delta(before, after, f"nv_inference_{p}_duration_us", model=model)
                 for p in _COMPUTE)
        rows.append(ModelTime(model, int(delta(before, after, "nv_inference_exec_count",
                                                model=model)),
                              delta(before, after, "nv_inference_queue_duration_us",
                                    model=model) / 1e6, us / 1e6))
    return sorted(rows, key=lambda r: -r.compute_seconds)

"""A clean stop of a context or generation server fails no request.

On Ctrl-C / SIGTERM, ``serve context|generation`` first deregisters (with discovery), then
waits before it stops tritonserver: ``NOTICE_SECONDS`` for every scheduler to stop routing
to it (they poll etcd every 0.25 s), then until its work is done, read from its own
metrics endpoint: no KV blocks in use (a context server's handoffs not yet fetched, a
generation server's sequences), no live sequences, no queued prompt tokens. Stopping
tritonserver at once would cancel every sequence its decode loop holds: Triton waits for
its in-flight requests, but generation answers each request at once and streams the
tokens over ZeroMQ.

Invariant: the wait ends after ``DRAIN_SECONDS`` at most, or at once on a second signal;
serve says how much work it waited for and how long it took.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from triton_disagg.routing.scrape import scrape, total
from triton_disagg.routing.discovery.metrics_load import LIVE, QUEUED, USED

NOTICE_SECONDS = 1.0
DRAIN_SECONDS = 30.0
POLL_SECONDS = 0.1
# the gauges a registered server publishes as its load (discovery.metrics_load), by meaning
WORK = {USED: "KV blocks in use", LIVE: "live sequences", QUEUED: "queued prompt tokens"}


def work_left(metrics_url: str, role: str) -> dict[str, int]:
    """What ``role``'s server still has to do, by gauge; {} when it has nothing."""
    samples = scrape(metrics_url, timeout=1.0)
    left = {name: int(total(samples, name, role=role)) for name in WORK}
    return {name: n for name, n in left.items() if n}


def drain(metrics_url: str | None, role: str, hurry: threading.Event,
          say: Callable[[str], None]) -> None:
    """Wait until the server at ``metrics_url`` has no work left (module docstring); with no
    metrics endpoint, only ``NOTICE_SECONDS``."""
    if hurry.wait(NOTICE_SECONDS) or metrics_url is None:
        return
    start = time.monotonic()
    try:
        left = work_left(metrics_url, role)
        if left:
            say("draining: " + ", ".join(f"{n} {WORK[name]}" for name, n in left.items()))
        while left and not hurry.wait(POLL_SECONDS):
            if time.monotonic() - start > DRAIN_SECONDS:
                say(f"still busy after {DRAIN_SECONDS:g} s; stopping anyway")
                return
            left = work_left(metrics_url, role)
    except OSError as exc:
        say(f"cannot read its load ({exc}); stopping")
        return
    say(f"drained in {NOTICE_SECONDS + time.monotonic() - start:.1f} s")

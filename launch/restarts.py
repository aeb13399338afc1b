"""How often ``serve`` restarts a failed tritonserver, and what it keeps of each stopped
server's log: at most ``MAX_RESTARTS`` restarts within any ``RESTART_WINDOW_SECONDS`` (a
crash loop ends, rare deaths over a long life never add up), and the last ``MAX_RESTARTS``
stopped servers' logs (``tritonserver.N.log``)."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Callable

MAX_RESTARTS = 5            # stub deaths and failed starts survived by restarting, within
RESTART_WINDOW_SECONDS = 600.0    # this long: a crash loop ends, rare deaths never add up


class RestartBudget:
    """At most ``MAX_RESTARTS`` restarts within any ``RESTART_WINDOW_SECONDS`` (``clock``:
    ``time.monotonic``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.spent: deque[float] = deque()      # when the restarts of the window were

    def spend(self) -> bool:
        """Take one restart now; False when the window already holds ``MAX_RESTARTS``."""
        now = self.clock()
        while self.spent and now - self.spent[0] >= RESTART_WINDOW_SECONDS:
            self.spent.popleft()
        if len(self.spent) >= MAX_RESTARTS:
            return False
        self.spent.append(now)
        return True


def kept_log(work_dir: Path, restart: int) -> Path:
    """Where the log of the server stopped before restart ``restart`` (1, 2, ...) is kept."""
    return work_dir / f"tritonserver.{restart}.log"


def keep_log(work_dir: Path, restart: int) -> None:
    """Keep the stopped server's log for restart ``restart`` (:func:`kept_log`; a start
    that failed before tritonserver wrote its log leaves none to keep); only the newest
    ``MAX_RESTARTS`` kept logs stay, this run's or an earlier run's in the same work
    directory, so a server restarted now and then over a long life does not fill it."""
    log = work_dir / "tritonserver.log"
    if log.exists():
        log.replace(kept_log(work_dir, restart))
    kept = sorted(work_dir.glob("tritonserver.*.log"), key=_age)
    for old in kept[:-MAX_RESTARTS]:
        old.unlink(missing_ok=True)


def _age(log: Path) -> tuple[int, int]:
    """Oldest first: last written, then restart number (file times are coarse)."""
    number = log.name.split(".")[1]
    return log.stat().st_mtime_ns, int(number) if number.isdigit() else 0

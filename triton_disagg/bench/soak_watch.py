"""What `bench soak` watches while the load runs: its own requests' ends and the stubs'
memory (the server's logs and KV pools afterwards: :mod:`.soak_server`).

Everything here reads public surfaces only (the ensemble's replies, ``/proc``), so it
holds whatever runs inside the models.

- :class:`RequestLog`: every request the soak's own clients send is a :class:`Record`
  with a deadline of ``SLACK_SECONDS + SECONDS_PER_TOKEN * max_tokens`` after it was
  sent. Invariant: a record is *hung* when it ended after its deadline, or has not
  ended and its deadline has passed; otherwise it counts under the outcome it ended with.
  A request read to its end whose token count is wrong (:func:`token_count_problem`) is
  an unexpected error and is also counted as *miscounted*: tokens lost on the way.
- :class:`ClientThread`: each load generator runs in one; it keeps what ended it.
  Invariant: a client whose function raised, or that still runs when the soak stops
  waiting for it, failed the soak (its requests cannot all have been counted).
- :class:`RssSampler`: every stub process's resident memory (and tritonserver's), by
  model instance, every few seconds; :func:`rss_rows` judges flatness over a window.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from triton_disagg.triton.stub_watch import children_running, stubs_of

SLACK_SECONDS = 30.0
SECONDS_PER_TOKEN = 0.5
OUTCOMES = ("ok", "expected_error", "unexpected_error")
RSS_FLAT = 0.10
SERVER = "tritonserver"          # the RSS row of the server process itself


def token_count_problem(responses: int, num_output_tokens: int | None, max_tokens: int
                        ) -> str | None:
    """What is wrong with the token count of a reply read to its end that must hold exactly
    ``max_tokens`` tokens (end id off, finish reason ``length``), or None: the count the
    server reports (``num_output_tokens``; the text responses without it) must be
    ``max_tokens``, and no more text responses than tokens may have come."""
    got = num_output_tokens if num_output_tokens is not None else responses
    if got != max_tokens:
        return f"asked for {max_tokens} tokens, got {got}"
    if responses > got:
        return f"{responses} text responses for {got} tokens"
    return None


def deadline_seconds(max_tokens: int) -> float:
    """How long a request asking for ``max_tokens`` may take before it counts as hung."""
    return SLACK_SECONDS + SECONDS_PER_TOKEN * max(0, max_tokens)


@dataclass
class Record:
    kind: str
    max_tokens: int
    start: float = field(default_factory=time.monotonic)
    end: float | None = None
    outcome: str | None = None
    detail: str = ""
    miscounted: bool = False          # read to its end with a wrong token count

    @property
    def deadline(self) -> float:
        return self.start + deadline_seconds(self.max_tokens)

    def state(self, now: float) -> str | None:
        """An outcome, ``hung``, or None while it may still end in time."""
        if self.end is None:
            return "hung" if now > self.deadline else None
        return "hung" if self.end > self.deadline else self.outcome


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    expected_error: int = 0
    unexpected_error: int = 0
    hung: int = 0
    open: int = 0                       # not ended, deadline not yet passed
    miscounted: int = 0                 # ended with a token count that is wrong
    examples: list[str] = field(default_factory=list)   # what went wrong, a few


class RequestLog:
    """Thread-safe list of :class:`Record`; clients call :meth:`begin` then :meth:`finish`."""

    def __init__(self):
        self._records: list[Record] = []
        self._lock = threading.Lock()

    def begin(self, kind: str, max_tokens: int) -> Record:
        record = Record(kind, max_tokens)
        with self._lock:
            self._records.append(record)
        return record

    @staticmethod
    def finish(record: Record, outcome: str, detail: str = "", miscounted: bool = False
               ) -> None:
        assert outcome in OUTCOMES, outcome
        record.end, record.outcome, record.detail = time.monotonic(), outcome, detail[:200]
        record.miscounted = miscounted

    def open_deadline(self) -> float | None:
        """The latest deadline among records not yet ended (None: all ended)."""
        with self._lock:
            left = [r.deadline for r in self._records if r.end is None]
        return max(left) if left else None

    def tally(self, now: float | None = None) -> dict[str, Tally]:
        now = time.monotonic() if now is None else now
        out: dict[str, Tally] = {}
        with self._lock:
            records = list(self._records)
        for r in records:
            t = out.setdefault(r.kind, Tally())
            t.sent += 1
            t.miscounted += r.miscounted
            state = r.state(now)
            if state is None:
                t.open += 1
                continue
            setattr(t, state, getattr(t, state) + 1)
            if state in ("hung", "unexpected_error") and len(t.examples) < 3:
                waited = (r.end or now) - r.start
                t.examples.append(f"{state} after {waited:.1f} s (max_tokens {r.max_tokens})"
                                  + (f": {r.detail}" if r.detail else ""))
        return out


class ClientThread(threading.Thread):
    """A daemon thread running ``target(*args)``, one of the soak's clients, named ``name``
    in its verdict; :meth:`failure` after the soak's wait says whether it ran to its end."""

    def __init__(self, name: str, target: Callable[..., None], *args: object):
        super().__init__(name=name, daemon=True)
        self._call, self._args = target, args
        self._returned = False
        self._error: str | None = None

    def run(self) -> None:
        try:
            self._call(*self._args)
            self._returned = True
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            self._error = (f"{type(e).__name__}: {e} "
                           f"(at {Path(where.filename).name}:{where.lineno})")
            traceback.print_exc(file=sys.stderr)

    def failure(self) -> str | None:
        """None when ``target`` returned; else what went wrong, in words."""
        if self._returned:
            return None
        if self._error is not None:
            return f"ended with {self._error}"
        return "still running when the soak stopped waiting" if self.is_alive() \
            else "never started"


# --- memory ---------------------------------------------------------------------------

def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def server_pids(parent: int) -> list[int]:
    """Children of ``parent`` (the ``serve`` process) that run tritonserver."""
    return [pid for pid, _ in children_running(parent, "tritonserver")]


class RssSampler(threading.Thread):
    """Samples ``{instance: [(t, pid, kib)]}`` every ``period`` seconds until :meth:`stop`."""

    def __init__(self, serve_pid: int, period: float = 5.0):
        super().__init__(daemon=True, name="rss-sampler")
        self.serve_pid, self.period = serve_pid, period
        self.samples: dict[str, list[tuple[float, int, int]]] = defaultdict(list)
        self._halt = threading.Event()

    def sample(self) -> None:
        now = time.monotonic()
        for server in server_pids(self.serve_pid):
            procs = [(SERVER, server)] + [(s.instance, s.pid) for s in stubs_of(server)]
            for name, pid in procs:
                kib = rss_kib(pid)
                if kib is not None:
                    self.samples[name].append((now, pid, kib))

    def run(self) -> None:
        while True:
            self.sample()
            if self._halt.wait(self.period):
                return

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


@dataclass(frozen=True)
class RssRow:
    process: str
    samples: int
    first_mib: float
    last_mib: float
    min_mib: float
    max_mib: float
    restarted: bool             # the instance's pid changed inside the window

    @property
    def spread(self) -> float:
        """(max - min) / min over the window."""
        return (self.max_mib - self.min_mib) / self.min_mib if self.min_mib else 0.0

    @property
    def flat(self) -> bool:
        return self.spread <= RSS_FLAT and not self.restarted

    @property
    def judged(self) -> bool:
        """Stubs are judged (issue 9's criterion); tritonserver's own memory is shown only."""
        return self.process != SERVER


def rss_rows(samples: dict[str, list[tuple[float, int, int]]], since: float,
             until: float) -> list[RssRow]:
    """One row per process with samples inside ``[since, until]``."""
    rows = []
    for name in sorted(samples, key=lambda n: (n != SERVER, n)):
        window = [(t, pid, kib / 1024) for t, pid, kib in samples[name] if since <= t <= until]
        if not window:
            continue
        mib = [m for _, _, m in window]
        rows.append(RssRow(name, len(window), mib[0], mib[-1], min(mib), max(mib),
                           len({pid for _, pid, _ in window}) > 1))
    return rows

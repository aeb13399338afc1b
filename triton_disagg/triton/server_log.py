"""What tritonserver's log says while it starts: models loaded, the cause of a failure.

Triton reports a model that cannot load (a stub that cannot start, a ``model.py``
whose ``initialize`` raises) or a port already taken somewhere inside a screen of
log, beside lines that every start on a CPU host prints (NVML, DCGM, CUDA driver)
and that mean nothing there. :class:`LogFollower` reads the log as it grows, so
``serve`` can show progress, stop at the first fatal line, and quote it first.

Invariant: :func:`fatal_cause` and :func:`loaded_model` look at one line at a time
and never at a line that :func:`is_cpu_noise` drops.
"""

from __future__ import annotations

import re
from pathlib import Path

# Printed on every start of the GPU-built server on a host without a GPU driver;
# harmless there (docs/observability.md, "Expected log lines on a CPU host").
CPU_NOISE = (
    "CUDA driver version is insufficient",
    "CudaDriverHelper has not been initialized",
    "CUDA memory pool disabled",
    "Failed to initialize NVML",
    "DCGM unable to start",
)

_LOADED = re.compile(r"successfully loaded '([^']+)'")
_FATAL = (
    (re.compile(r"failed to load '([^']+)' version \d+: (?:Internal: )?(.*)"),
     "model '{0}' failed to load: {1}"),
    (re.compile(r"error while loading shared libraries: (.*)"),
     "Triton's Python backend stub cannot start: {0}"),
    (re.compile(r"failed to start (\w+) service: (.*)"), "{0} endpoint failed to start: {1}"),
)


_TAKEN = re.compile(r"Socket '[^']*:(\d+)' already in use")


def taken_port(line: str) -> int | None:
    """The port a "Socket 'host:port' already in use" line names, else None."""
    m = _TAKEN.search(line)
    return int(m.group(1)) if m else None


# Triton's level letter, after the ISO8601 time that --log-format=ISO8601 puts first.
_LEVEL = re.compile(r"^(?:\d{4}-\d\d-\d\dT[\d:.]+Z )?([EWIV])")


def level(line: str) -> str | None:
    """The level letter (E, W, I, V) of a tritonserver line in either of its formats."""
    m = _LEVEL.match(line)
    return m.group(1) if m else None


def is_cpu_noise(line: str) -> bool:
    return any(text in line for text in CPU_NOISE)


def loaded_model(line: str) -> str | None:
    """The model a "successfully loaded" line names, else None."""
    m = _LOADED.search(line)
    return m.group(1) if m else None


def fatal_cause(line: str) -> str | None:
    """One line naming what failed, when ``line`` reports a failure that stops the start."""
    for pattern, message in _FATAL:
        m = pattern.search(line)
        if m:
            return message.format(*(_first_line(g) for g in m.groups()))
    return None


def tail(text: str, lines: int = 20) -> str:
    """The last ``lines`` error lines of a log (every line when it has none), without the
    CPU-host noise and Triton's status tables."""
    kept = [t for t in text.splitlines()
            if t.strip() and not is_cpu_noise(t) and not t.startswith(("+", "|"))]
    errors = [t for t in kept if level(t) == "E" or "error" in t.lower()]
    return "\n".join((errors or kept)[-lines:])


class LogFollower:
    """Reads the complete lines appended to a log file since the last call."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        self._offset += len(data)
        *complete, self._partial = (self._partial + data).split(b"\n")
        return [line.decode(errors="replace") for line in complete]


def _first_line(text: str) -> str:
    """Triton quotes a Python traceback with literal ``\\n``: keep the message before it."""
    return text.split("\\n")[0].strip().rstrip('"').strip()

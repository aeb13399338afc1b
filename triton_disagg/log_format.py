"""Log lines an operator can search: ``serve --log-format json`` makes every line one JSON
object with ``time`` (ISO8601, UTC), ``level``, ``role``, ``instance``, ``request_id``
and ``message``, in serve's own output and in each stub's Python logging.

serve passes the format and its role to tritonserver, hence to every stub, in the
environment (:data:`FORMAT_ENV`, :data:`ROLE_ENV`); each model's ``initialize`` calls
:func:`configure_stub` with its instance name. A request's lines carry its id: code that
serves a request sets :data:`request_id` (a context variable, so each asyncio task and
each thread keeps its own) or passes ``extra={"request_id": ...}``.

Invariants: in json mode every line a stub's Python logging writes and every line serve
prints is one JSON object; in text mode (the default) nothing changes but that requests'
lines (INFO) are not shown. tritonserver's own lines are written by tritonserver, with
ISO8601 time (``--log-format=ISO8601``), and are not JSON.
"""

from __future__ import annotations

import contextvars
import io
import json
import logging
import os
import sys
import time
from typing import TextIO

FORMATS = ("text", "json")
FORMAT_ENV = "TRITON_DISAGG_LOG_FORMAT"
ROLE_ENV = "TRITON_DISAGG_ROLE"

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id",
                                                                        default=None)


def _now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def json_line(level: str, role: str, instance: str, message: str,
              rid: str | None = None) -> str:
    """One log line as a JSON object (no newline)."""
    return json.dumps({"time": _now(), "level": level, "role": role, "instance": instance,
                       "request_id": rid, "message": message}, ensure_ascii=False)


def error_line(message: str) -> str:
    """The command's last word on a failure: as :func:`json_line` once ``serve
    --log-format json`` chose JSON (the environment says), else as it is."""
    if os.environ.get(FORMAT_ENV) != "json":
        return message
    return json_line("ERROR", os.environ.get(ROLE_ENV, "?"), "serve", message)


class JsonFormatter(logging.Formatter):
    """A record as :func:`json_line`; a traceback goes into the message, escaped."""

    def __init__(self, role: str, instance: str):
        super().__init__()
        self.role, self.instance = role, instance

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        rid = getattr(record, "request_id", None) or request_id.get()
        return json_line(record.levelname, self.role, self.instance, message, rid)


def configure_stub(instance: str) -> None:
    """A stub's Python logging, as serve's ``--log-format`` asks (the environment): json,
    one object per line on stderr (tritonserver's log) from INFO up; text: as before."""
    if os.environ.get(FORMAT_ENV) != "json":
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(os.environ.get(ROLE_ENV, "?"), instance))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def adopt_logger(name: str) -> None:
    """In json mode, the logger ``name``, which its library gave a handler of its own (NIXL
    writes plain lines to stdout), writes through the stub's JSON handler instead."""
    if os.environ.get(FORMAT_ENV) == "json":
        logging.getLogger(name).handlers[:] = logging.getLogger().handlers


class JsonLines(io.TextIOBase):
    """serve's stdout in json mode: every complete line printed becomes one JSON object
    (level INFO, instance ``serve``)."""

    def __init__(self, out: TextIO, role: str):
        self.out, self.role, self._partial = out, role, ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self.out.write(json_line("INFO", self.role, "serve", line) + "\n")
        return len(text)

    def flush(self) -> None:
        self.out.flush()


class Rejections:
    """One WARNING line per rejected request (its status and reason, on ``logger``), at most
    ``per_second`` a second: past that, one line says how many went unlogged."""

    def __init__(self, logger: logging.Logger, per_second: int = 10,
                 clock=time.monotonic):
        self.logger, self.per_second, self.clock = logger, per_second, clock
        self.window, self.logged, self.dropped = clock(), 0, 0

    def rejected(self, status: str, reason: str, rid: str | None = None) -> None:
        now = self.clock()
        if now - self.window >= 1.0:
            if self.dropped:
                self.logger.warning("%d more rejected requests not logged (at most %d lines "
                                    "a second)", self.dropped, self.per_second)
            self.window, self.logged, self.dropped = now, 0, 0
        if self.logged >= self.per_second:
            self.dropped += 1
            return
        self.logged += 1
        self.logger.warning("request rejected (%s): %s", status, reason,
                            extra={"request_id": rid} if rid else None)

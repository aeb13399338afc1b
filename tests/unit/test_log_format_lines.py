"""log_format: JSON lines with every field, the request id from a record or the context
variable, serve's stdout wrapped line by line, rejected requests rate-limited."""

from __future__ import annotations

import io
import json
import logging

from triton_disagg import log_format
from triton_disagg.front.orchestrator import _call_id

FIELDS = {"time", "level", "role", "instance", "request_id", "message"}


def _record(message: str, **extra) -> logging.LogRecord:
    record = logging.LogRecord("t", logging.WARNING, __file__, 1, message, (), None)
    record.__dict__.update(extra)
    return record


def test_formatter_writes_one_json_object_with_the_request_id():
    formatter = log_format.JsonFormatter("scheduler", "orchestrator_0_0")
    line = json.loads(formatter.format(_record("two\nlines", request_id="abc")))
    assert set(line) == FIELDS and line["request_id"] == "abc" and line["message"] == "two\nlines"
    assert line["role"] == "scheduler" and line["level"] == "WARNING"
    assert line["time"].endswith("Z") and "T" in line["time"]
    token = log_format.request_id.set("from-context")
    try:
        assert json.loads(formatter.format(_record("x")))["request_id"] == "from-context"
    finally:
        log_format.request_id.reset(token)


def test_serve_output_becomes_json_lines_only_for_complete_lines():
    out = io.StringIO()
    lines = log_format.JsonLines(out, "all")
    lines.write("ready (\n  HTTP ")
    lines.write("http://x\n")
    parsed = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [p["message"] for p in parsed] == ["ready (", "  HTTP http://x"]
    assert {p["instance"] for p in parsed} == {"serve"}


def test_rejections_are_rate_limited_and_the_rest_counted():
    now = [0.0]
    seen: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("test_rejections")
    logger.addHandler(Capture())
    rejections = log_format.Rejections(logger, per_second=3, clock=lambda: now[0])
    for i in range(5):
        rejections.rejected("INVALID_ARG", f"bad {i}")
    assert seen == [f"request rejected (INVALID_ARG): bad {i}" for i in range(3)]
    now[0] = 1.5
    rejections.rejected("UNAVAILABLE", "gone")
    assert seen[3:] == ["2 more rejected requests not logged (at most 3 lines a second)",
                        "request rejected (UNAVAILABLE): gone"]


def test_call_ids_start_with_the_clients_id_and_are_unique():
    first, second = _call_id("client-7"), _call_id("client-7")
    assert first.startswith("client-7-") and second.startswith("client-7-") and first != second
    assert _call_id("x" * 500).startswith("x" * 64 + "-") and len(_call_id("")) == 32


def test_a_commands_error_line_is_json_once_serve_chose_json(monkeypatch):
    message = "triton-disagg serve: error: tritonserver not ready after 300s"
    monkeypatch.delenv(log_format.FORMAT_ENV, raising=False)
    assert log_format.error_line(message) == message
    monkeypatch.setenv(log_format.FORMAT_ENV, "json")
    monkeypatch.setenv(log_format.ROLE_ENV, "generation")
    record = json.loads(log_format.error_line(message))
    assert record["level"] == "ERROR" and record["role"] == "generation"
    assert record["message"] == message

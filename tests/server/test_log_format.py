"""``serve all --log-format json`` on a real tritonserver: every line serve prints and every
line of the work dir's log is a JSON object (time, level, role, instance, request_id,
message) or one of tritonserver's own ISO8601 lines (with the tables it prints at start
and stop, its raw "Signal (15) received." and the CPU-host lines it prints raw:
``server_log.CPU_NOISE``); the Triton request id a client sets is found, by one grep, in the
orchestrator's, the context's and the generation's lines; a rejected request leaves one
WARNING line with its status; no ERROR line on a healthy start and stop."""

from __future__ import annotations

import json
import re

import numpy as np

import servers
from triton_disagg.clients.stream import array_inputs
from triton_disagg.triton.server_log import is_cpu_noise

REQUEST_ID = "ops-log-probe-7f3a"
FIELDS = {"time", "level", "role", "instance", "request_id", "message"}
TRITON_LINE = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z [EWIV] \d+ \S+:\d+\] ")
TABLE_LINE = re.compile(r"^[+|]")       # tritonserver's model and option tables
SIGNAL_LINE = re.compile(r"^Signal \(\d+\) received\.$")   # tritonserver's, raw, at stop


def _stream(grpc: str, text: str, max_tokens: int, request_id: str) -> str | None:
    """One gRPC stream request with ``request_id``; its error message, None when it ended."""
    import queue

    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    arrays = {"text_input": np.array([[text.encode()]], dtype=object),
              "max_tokens": np.array([[max_tokens]], dtype=np.int32),
              "stream": np.array([[True]], dtype=bool)}
    with grpcclient.InferenceServerClient(grpc) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        tensors = array_inputs(arrays)
        client.async_stream_infer("ensemble", tensors, request_id=request_id,
                                  enable_empty_final_response=True)
        try:
            while True:
                result, error = results.get(timeout=120)
                if error is not None:
                    return error.message()
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return None
        finally:
            client.stop_stream()


def _json_lines(text: str, where: str) -> list[dict]:
    """Every line of ``text`` that is not tritonserver's own, parsed; each must be JSON."""
    parsed = []
    for line in text.splitlines():
        if (not line.strip() or TRITON_LINE.match(line) or TABLE_LINE.match(line)
                or SIGNAL_LINE.match(line) or is_cpu_noise(line)):     # what the GPU build prints raw on a CPU host
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"{where}: not JSON nor tritonserver's ISO8601 line: {line!r}")
        assert set(record) == FIELDS, (where, record)
        parsed.append(record)
    return parsed


def test_json_logs_carry_the_request_id_to_every_role(demo_engine, tmp_path):
    args = ["--engine", str(demo_engine), "--log-format", "json"]
    with servers.serve("all", args, tmp_path / "run") as served:
        assert _stream(served.grpc, "The quick brown fox", 8, REQUEST_ID) is None
        error = _stream(served.grpc, "The quick brown fox", 0, "ops-bad-input")
        assert error is not None and "max_tokens" in error
        assert servers.stop(served) == 0
    cli = _json_lines(served.log.read_text(), "serve's output")
    assert any("ready (" in r["message"] for r in cli) and {r["instance"] for r in cli} == {"serve"}
    server_text = served.server_log()
    assert any(TRITON_LINE.match(line) for line in server_text.splitlines())
    records = _json_lines(server_text, "tritonserver.log")
    mine = [r for r in records if REQUEST_ID in (r["request_id"] or "")]
    instances = {r["instance"].split("_")[0] for r in mine}
    assert instances == {"orchestrator", "context", "generation"}, mine
    assert all(r["role"] == "all" for r in mine)
    rejected = [r for r in records if "request rejected (INVALID_ARG)" in r["message"]]
    assert len(rejected) == 1 and rejected[0]["level"] == "WARNING", rejected
    assert "ERROR" not in served.log.read_text() + server_text

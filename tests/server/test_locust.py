"""clients/locustfile.py: a short headless locust run against `serve all`, all three users
(gRPC, HTTP generate_stream, the front's OpenAI API), no
failed request, and the TTFT / time-per-output-token / e2e entries of each."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import servers

LOCUSTFILE = Path(__file__).resolve().parents[2] / "clients" / "locustfile.py"
KINDS = ("grpc_stream", "http_stream", "openai_stream")
ENTRIES = ("ttft", "time_per_output_token", "e2e")


def test_headless_locust_run_has_no_failures(demo_engine, tmp_path):
    with servers.serve("all", ["--engine", str(demo_engine)], tmp_path / "server") as served:
        env = dict(os.environ, TD_GRPC_URL=served.grpc, TD_FRONT_URL=served.front,
                   TD_TOKENIZER=str(demo_engine),
                   TD_PROMPT_TOKENS="uniform:8,32", TD_OUTPUT_TOKENS="uniform:4,16", TD_SEED="0")
        done = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "6",
             "-r", "6", "-t", "10s", "--host", served.http, "--csv", str(tmp_path / "run"),
             "--only-summary"],
            env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    report = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, report
    with open(tmp_path / "run_stats.csv", newline="") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    for kind in KINDS:
        for entry in ENTRIES:
            row = rows.get((kind, entry))
            assert row is not None, f"no {kind} {entry} entry:\n{report}"
            assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, report
        e2e, ttft = float(rows[kind, "e2e"]["Median Response Time"]), \
            float(rows[kind, "ttft"]["Median Response Time"])
        assert 0 < ttft <= e2e
    assert int(rows["", "Aggregated"]["Failure Count"]) == 0

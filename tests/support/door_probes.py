"""What the server tests of Triton's doors share (tests/server/test_served_grpc_door.py,
test_served_http_doors.py): tritonserver's own flags and peak memory behind a `serve`, a
POST that reports a closed connection instead of raising, and the metrics door's check."""

from __future__ import annotations

import http.client
import re
import time
from pathlib import Path

import servers

SIZE = 64 * 2**20               # a message or body far over the doors' bound
UNMOVED_BYTES = 16 * 2**20      # tritonserver's peak may move this much for other reasons
METRICS_POST_BYTES = 16 * 10**6     # Triton 2.51's metrics server died on a form this large
FORM = "application/x-www-form-urlencoded"      # curl's -d / --data-binary default


def flag(served, name: str) -> str:
    """The value of the tritonserver flag ``--name`` that ``served`` started it with."""
    return servers.tritonserver_flag(served.work_dir, name)


def peak_rss(served) -> int:
    """tritonserver's peak resident bytes so far."""
    status = Path(f"/proc/{servers.tritonserver_pid(served.work_dir)}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def post(url: str, path: str, body: bytes, content_type: str = FORM) -> tuple[int | None, bytes]:
    """POST ``body`` to ``url`` + ``path`` (by default as curl's ``-d`` sends it): (the
    status, or None when the server closed the connection instead; the answer)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": content_type})
        response = conn.getresponse()
        return response.status, response.read()
    except (ConnectionError, http.client.HTTPException):
        return None, b""
    finally:
        conn.close()


def forms_refused_at_the_metrics_door(served) -> None:
    """Large form POSTs to ``served``'s metrics port are refused and its tritonserver, whose
    metrics listen on loopback behind the door, lives on and still answers a scrape."""
    assert flag(served, "metrics-address") == "127.0.0.1"
    assert flag(served, "metrics-port") != served.metrics.rsplit(":", 1)[1]
    pid = servers.tritonserver_pid(served.work_dir)
    for _ in range(3):
        assert post(served.metrics, "/metrics", bytes(METRICS_POST_BYTES))[0] in (405, 413, None)
    assert post(served.metrics, "/metrics", b"a" * 10)[0] == 405
    time.sleep(1)                       # a crash takes the process down within this
    assert servers.tritonserver_pid(served.work_dir) == pid
    text = servers.metrics(served.metrics)
    assert "nv_inference_request_success" in text and "disagg_kv_blocks_used" in text

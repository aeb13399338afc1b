"""The member record's JSON and the load read from a metrics endpoint (no etcd needed)."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from triton_disagg.routing.discovery import Load, MemberRecord
from triton_disagg.routing.discovery.metrics_load import metrics_load

RECORD = MemberRecord(role="context", grpc_url="ctx-01:8001", fingerprint="f" * 64,
                      kv_blocks_total=128, tokens_per_block=8, token_address="tcp://ctx-01:5555",
                      load=Load(free_kv_blocks=100, live_sequences=None, queued_prompt_tokens=7))


def test_round_trip():
    assert MemberRecord.from_json(RECORD.to_json()) == RECORD
    raw = json.loads(RECORD.to_json())
    assert raw["version"] == 1 and raw["load"]["live_sequences"] is None   # unknown, not 0
    assert raw["capacity"] == {"kv_blocks_total": 128, "tokens_per_block": 8}


@pytest.mark.parametrize("change, reason", [
    (lambda d: d.update(version=2), "version 1"),
    (lambda d: d.update(role="scheduler"), "role"),
    (lambda d: d.pop("grpc_url"), "grpc_url"),
    (lambda d: d["capacity"].update(kv_blocks_total="many"), "kv_blocks_total"),
    (lambda d: d["load"].update(free_kv_blocks=-1), "free_kv_blocks"),
    (lambda d: d.update(load=[]), "load"),
])
def test_malformed_records_say_why(change, reason):
    raw = json.loads(RECORD.to_json())
    change(raw)
    with pytest.raises(ValueError, match=reason):
        MemberRecord.from_json(json.dumps(raw).encode())


def test_not_json():
    with pytest.raises(ValueError, match="not JSON"):
        MemberRecord.from_json(b"{")


METRICS = """\
# TYPE disagg_kv_blocks_used gauge
disagg_kv_blocks_used{model_instance="generation_0_0",role="generation"} 3
disagg_kv_blocks_used{model_instance="generation_1_0",role="generation"} 5
disagg_kv_blocks_used{model_instance="orchestrator_0_0",role="orchestrator"} 50
disagg_kv_blocks_total{model_instance="generation_0_0",role="generation"} 64
disagg_kv_blocks_total{model_instance="generation_1_0",role="generation"} 64
"""


def test_load_from_the_metrics_endpoint():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(METRICS.encode())

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        read = metrics_load(f"http://127.0.0.1:{server.server_port}", "generation")
        assert read() == Load(free_kv_blocks=64 + 64 - 3 - 5)     # other roles left out
        assert metrics_load(f"http://127.0.0.1:{server.server_port}", "context")() == Load()
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(OSError):
        read()

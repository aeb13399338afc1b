"""``scheduler_server.max_concurrent_requests`` on a real ``serve all`` (issue 27, item 4):
with a cap of 2 per orchestrator instance, 6 long streams sent at once through the
ensemble over gRPC (each seconds of decode, so a loaded machine's spread of the sends
cannot let a third in): 2 are served to their end with the offline text, 4 are refused at once
with one line saying the server is busy (or, in a burst, that preprocessing's queue, which
holds the cap, is full), and once the 2 are done a new request is served
(the slots came back) and no KV block is held."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import servers
from triton_disagg.routing.scrape import scrape, total

CAP, SENT, LONG = 2, 6, 1500     # LONG: seconds of decode, far longer than the sends' spread


def _send(grpc: str) -> tuple[float, str]:
    begun = time.monotonic()
    try:
        return time.monotonic() - begun, "".join(servers.grpc_stream(
            grpc, "The quick brown fox", LONG, extra={"min_tokens": np.array([[LONG]], dtype=np.int32)}))
    except RuntimeError as exc:
        return time.monotonic() - begun, f"error: {exc}"


def test_past_the_cap_a_request_is_refused_at_once_and_slots_come_back(demo_engine, tmp_path):
    config = (f"model: {{engine: {demo_engine}}}\n"
              f"scheduler_server: {{max_concurrent_requests: {CAP}}}\n")
    offline = servers.offline_text(demo_engine)
    with servers.serve_config(config, tmp_path) as served:
        with ThreadPoolExecutor(SENT) as pool:
            results = list(pool.map(lambda _: _send(served.grpc), range(SENT)))
        refused = [(t, r) for t, r in results if r.startswith("error:")]
        served_texts = [r for _, r in results if not r.startswith("error:")]
        assert len(served_texts) == CAP and len(refused) == SENT - CAP, results
        for took, message in refused:   # by the orchestrator, or preprocessing's queue first
            assert ("busy" in message and "retry later" in message
                    or "Exceeds maximum queue size" in message), message
            assert "\n" not in message.strip() and took < 10, (took, message)
        assert len({len(text) for text in served_texts}) == 1
        assert servers.generate(served.http, {"text_input": "The quick brown fox",
                                              "max_tokens": 8})[1]["text_output"] == \
            offline("The quick brown fox", 8)
        servers.wait_until(lambda: total(scrape(served.metrics),
                                         "disagg_kv_blocks_used") == 0, 30, "every block back")


def _preprocess(http: str, text: str) -> tuple[int, str]:
    """Preprocessing called straight over Triton's HTTP, as a client of the public ports may."""
    import json
    import urllib.error
    import urllib.request

    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": [text]},
                       {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [1]}]}
    request = urllib.request.Request(f"{http}/v2/models/preprocessing/infer",
                                     json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_preprocessing_queues_at_most_the_cap(demo_engine, tmp_path):
    """Issue 27 re-review (medium): preprocessing's one instance tokenizes every request it
    is given before any cap, and Triton queued them without bound, so a flood of direct calls
    made every ensemble request wait behind it. Its queue holds the orchestrators' cap: past
    it a call is UNAVAILABLE at once, and the server serves again once the flood is gone."""
    config = (f"model: {{engine: {demo_engine}}}\n"
              f"scheduler_server: {{max_concurrent_requests: {CAP}}}\n")
    flood, text = 48, "The quick brown fox " * 3000          # 60 KB each, tokenized whole
    with servers.serve_config(config, tmp_path) as served:
        with ThreadPoolExecutor(flood) as pool:
            answers = list(pool.map(lambda _: _preprocess(served.http, text), range(flood)))
        refused = [body for status, body in answers if status == 503]
        assert refused and all("queue" in body for body in refused), answers[:3]
        assert {status for status, _ in answers} <= {200, 400, 503}, answers[:3]
        assert servers.generate(served.http, {"text_input": "The quick brown fox",
                                              "max_tokens": 8})[1]["text_output"] == \
            servers.offline_text(demo_engine)("The quick brown fox", 8)

"""Triton's public HTTP port and every role's metrics port of ``serve`` go through doors
(:mod:`triton_disagg.front.http_door`, :mod:`triton_disagg.front.metrics_door`); tritonserver
listens on loopback behind them. The HTTP door refuses, unread by tritonserver, a body over
the front's bound before it is sent, a chunked or compressed one, and a JSON body of
millions of strings or numbers; it forwards no form body (one killed Triton 2.51's HTTP
server). The metrics door answers a bodiless GET alone, so a form POST that killed Triton
2.51's metrics server no longer reaches it. The gRPC door: test_served_grpc_door.py."""

from __future__ import annotations

import gzip
import http.client
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import servers
from door_probes import SIZE, UNMOVED_BYTES, forms_refused_at_the_metrics_door, peak_rss, post
from triton_disagg.front.openai_api import MAX_BODY_BYTES

JSON = "application/json"


def test_a_large_http_body_is_refused_at_the_door_before_it_is_sent(server):
    host, port = server.http.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:                # the headers alone: the door answers without waiting for the body
        conn.putrequest("POST", "/v2/models/ensemble/generate")
        conn.putheader("Content-Length", str(SIZE))
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 413, response.read()
        assert str(MAX_BODY_BYTES) in response.read().decode()
    finally:
        conn.close()


def test_a_chunked_or_compressed_body_is_refused_at_the_door(server):
    def chunks():
        for _ in range(MAX_BODY_BYTES // 2**20 + 2):
            yield b"a" * 2**20

    chunked = urllib.request.Request(server.http + "/v2/models/ensemble/generate",
                                     data=chunks(), headers={"Transfer-Encoding": "chunked"})
    with pytest.raises(urllib.error.HTTPError, match="413"):
        urllib.request.urlopen(chunked, timeout=30)
    gzipped = urllib.request.Request(server.http + "/v2/models/ensemble/generate",
                                     data=gzip.compress(b"{}"),
                                     headers={"Content-Encoding": "gzip"})
    with pytest.raises(urllib.error.HTTPError, match="415"):
        urllib.request.urlopen(gzipped, timeout=30)


def test_a_large_post_to_metrics_is_refused_at_the_door_and_tritonserver_lives(server):
    """rev27e: tritonserver 2.51's metrics server segfaulted on a ~16 MB form POST to
    /metrics (failed before the metrics door: the second POST found nobody listening), a
    port Prometheus scrapes on every role. The door answers a bodiless GET alone."""
    forms_refused_at_the_metrics_door(server)


def test_a_large_form_post_through_the_http_door_leaves_tritonserver_serving(server):
    """rev27f H1: Triton 2.51's HTTP server died (SIGSEGV) on an ~8 MB form body on any
    path, under the door's 10 MiB bound; the door forwards no form Content-Type, so the
    body is Triton's JSON, refused as such, and a JSON body sent as curl's ``-d`` works."""
    pid = servers.tritonserver_pid(server.work_dir)
    big = b"a" * (MAX_BODY_BYTES - 2**16)
    status, answer = post(server.http, "/v2/models/ensemble/generate", big)
    # measured: Triton 2.51 answers a body that is not JSON with 500
    assert status in (400, 500) and b"failed to parse the request JSON" in answer, answer
    status, answer = post(server.http, "/v2/health/ready", big)
    assert status is not None and 400 <= status < 500, (status, answer)
    time.sleep(1)
    assert servers.tritonserver_pid(server.work_dir) == pid
    status, answer = post(server.http, "/v2/models/ensemble/generate",
                          b'{"text_input": "The quick brown fox", "max_tokens": 4}')
    assert status == 200, answer


HTTP_EMPTY_STRINGS = 3_000_000      # '"",' each: a 9 MB body, under the door's 10 MiB
HTTP_NUMBERS = 4 * 2**20            # '0,' each: an 8 MB body (the gRPC door's MAX_NUMBERS)


def _infer_json(name: str, datatype: str, values: bytes, count: int) -> bytes:
    """preprocessing's infer body: a text, max_tokens and ``name``, ``count`` ``values``."""
    return (b'{"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], '
            b'"data": ["a"]}, {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], '
            b'"data": [4]}, {"name": "' + name.encode() + b'", "datatype": "'
            + datatype.encode() + b'", "shape": [1, ' + str(count).encode() + b'], "data": ['
            + b",".join([values] * count) + b"]}]}")


def test_an_http_body_of_millions_of_strings_or_numbers_is_refused_at_the_door(server):
    """Issue 27 (HTTP door): Triton's JSON parser holds each value as an object: a 9 MB
    infer body whose ``data`` is 3 million empty strings took tritonserver +100 MB (and the
    stub +52 MB), one of 4M numbers +136 MB. The door counts the JSON's strings and values
    from its bytes and refuses both unread by tritonserver, whose peak memory does not move
    (reset first: an earlier test's peak would hide a jump); and, as the gRPC door, an
    inference request naming a model not served."""
    from triton_disagg.front.door_guards import MAX_ENTRIES

    pid = servers.tritonserver_pid(server.work_dir)
    for body in (_infer_json("stop_words", "BYTES", b'""', HTTP_EMPTY_STRINGS),
                 _infer_json("input_ids", "INT32", b"0", HTTP_NUMBERS)):
        assert len(body) < MAX_BODY_BYTES
        Path(f"/proc/{pid}/clear_refs").write_text("5")     # VmHWM := VmRSS
        before = peak_rss(server)
        status, answer = post(server.http, "/v2/models/preprocessing/infer", body, JSON)
        assert status == 400 and f"at most {MAX_ENTRIES}".encode() in answer, (status, answer)
        assert peak_rss(server) - before < UNMOVED_BYTES
    status, answer = post(server.http, "/v2/models/nosuchmodel/generate", b"{}", JSON)
    assert status == 400 and b"'nosuchmodel' is not served here" in answer, answer

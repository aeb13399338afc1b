"""kill -9 of a model's stub process mid-stream, as an out-of-memory kill or a native
crash would end it. Triton 2.51 neither restarts the stub nor turns not-ready, so
`serve` stops the server and starts it afresh: the client gets an error within 5 s,
``/v2/health/ready`` fails within 5 s, and within 30 s the server serves the offline
engine's text again. One server takes the three kills in turn (so restarts repeat)."""

from __future__ import annotations

import os
import queue
import signal
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

import servers
from triton_disagg.triton.stub_watch import stubs_of

LONG = 1000   # tokens: a stream that lasts seconds on the demo engine


@pytest.fixture(scope="module")
def served(demo_engine, tmp_path_factory):
    with servers.serve("all", ["--engine", str(demo_engine)],
                       tmp_path_factory.mktemp("stub-death")) as served:
        yield served


def _ready(http: str) -> bool:
    try:
        with urllib.request.urlopen(f"{http}/v2/health/ready", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


def _server_pid(served: servers.Served) -> int:
    (entry,) = [p for p in servers.processes_under(served.work_dir) if "bin/tritonserver" in p]
    return int(entry.split(":")[0])


def _start_long_stream(client, events: queue.Queue) -> None:
    values = {"text_input": np.array([[b"The quick brown fox"]], dtype=object),
              "max_tokens": np.array([[LONG]], dtype=np.int32),
              "min_tokens": np.array([[LONG]], dtype=np.int32),
              "stream": np.array([[True]], dtype=bool)}
    tensors = []
    for name, arr in values.items():
        dtype = "BYTES" if arr.dtype == object else grpcclient.np_to_triton_dtype(arr.dtype)
        tensors.append(grpcclient.InferInput(name, list(arr.shape), dtype))
        tensors[-1].set_data_from_numpy(arr)
    client.start_stream(callback=lambda result, error: events.put((time.monotonic(), error)))
    client.async_stream_infer("ensemble", tensors)


@pytest.mark.parametrize("model", ["generation", "context", "orchestrator"])
def test_a_killed_stub_errors_its_clients_turns_not_ready_and_recovers(served, demo_engine,
                                                                       model):
    offline = servers.offline_text(demo_engine)
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(served.grpc)
    try:
        _start_long_stream(client, events)
        _, error = events.get(timeout=60)                    # the first token: mid-stream now
        assert error is None, error
        (stub,) = [s for s in stubs_of(_server_pid(served)) if s.instance == f"{model}_0_0"]
        os.kill(stub.pid, signal.SIGKILL)
        killed = time.monotonic()
        while True:                                          # tokens, then the error
            at, error = events.get(timeout=5)
            if error is not None:
                break
        assert at - killed < 5.0, "the client's error came late"
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    while _ready(served.http):
        assert time.monotonic() - killed < 5.0, "still ready 5 s after the stub died"
        time.sleep(0.1)
    while not _ready(served.http):
        assert time.monotonic() - killed < 30.0, served.log.read_text()
        time.sleep(0.25)
    status, body = servers.generate(served.http, {"text_input": "The quick brown fox",
                                                  "max_tokens": 16})
    assert status == 200 and body["text_output"] == offline("The quick brown fox", 16)
    assert time.monotonic() - killed < 30.0
    assert f"the stub process of {model}_0_0" in served.log.read_text()

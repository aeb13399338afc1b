"""The HTTP front of a real `serve all` (disaggregated, the demo engine), called as its users
call it: the official ``openai`` SDK (completions and chat, streaming and not), the
deployment guide's ``requests.post(.../v1/inference)``, raw HTTP for bad inputs; greedy
text equals the offline engine's, Chinese and emoji included; a client that disconnects
frees its KV blocks; the front's process stops cleanly. One server for the module (a start
costs ~20 s; tests/server/conftest.py). What vLLM's and trtllm-serve's clients send:
tests/server/test_openai_extensions.py."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import requests

import servers
from front_server import MODEL, blocks_used
from servers import PROMPTS


@pytest.fixture(scope="module")
def chat_prompt(demo_engine):
    from triton_disagg.front.chat_template import ChatTemplate

    return lambda text: ChatTemplate.load(demo_engine).render([{"role": "user", "content": text}])


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    for path in ("/healthz", "/health"):
        resp = requests.get(server.front + path, timeout=10)
        assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    assert requests.get(server.front + "/version", timeout=10).json()["model"] == MODEL


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_greedy_equals_offline_streamed_or_not(client, offline, prompt):
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert whole.choices[0].text == offline(prompt, 20)
    assert whole.usage.completion_tokens <= 20 and whole.usage.prompt_tokens > 0
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                            temperature=0, stream=True))
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.parametrize("text", PROMPTS[1:3])
def test_chat_greedy_equals_offline_on_the_templated_prompt(client, offline, chat_prompt, text):
    messages = [{"role": "user", "content": text}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                           temperature=0)
    # the template's text as it is: no BOS added (vLLM's add_special_tokens=False for chat)
    assert whole.choices[0].message.content == offline(chat_prompt(text), 16, False)
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages,
                                            max_completion_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_the_final_response_says_why_the_request_ended(server, client):
    """The ensemble's final response carries ``finish_reason`` (``protocol.FinishReason``),
    and the front passes that on in OpenAI's words."""
    import queue

    import tritonclient.grpc as grpcclient

    from triton_disagg.clients.stream import GenerateRequest, grpc_inputs

    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc) as triton:
        triton.start_stream(callback=lambda result, error: results.put((result, error)))
        triton.async_stream_infer("ensemble", grpc_inputs(GenerateRequest(
            PROMPTS[0], 3, stream=False, options={"end_id": -1})))
        result, error = results.get(timeout=120)
        triton.stop_stream()
    assert error is None and result.as_numpy("finish_reason").reshape(-1).tolist() == [b"length"]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length"


def test_stop_sequence_ends_the_text_and_is_left_out(client, offline):
    full = offline(PROMPTS[0], 20)
    stop = full[5:9]
    assert stop.strip() and full.index(stop) == 5
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20,
                                    temperature=0, stop=[stop])
    assert got.choices[0].text == full[:5] and got.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(client):
    def draw():
        return client.completions.create(model=MODEL, prompt="a", max_tokens=12,
                                         temperature=1.0, top_p=0.9, seed=7).choices[0].text
    assert draw() == draw()


def test_the_guides_inference_request_prints_text(server, offline):
    # the deployment guide's verification request, as written there (plus a timeout)
    response = requests.post(f"{server.front}/v1/inference",
                             json={"prompt": "Hello, world!", "model": MODEL}, timeout=60)
    print(response.json())
    assert response.status_code == 200
    assert response.json()["text"] == offline("Hello, world!", 16)


@pytest.mark.parametrize("send, status, words", [
    (dict(data=b"{oops"), 400, "not valid JSON"),
    (dict(json={"model": MODEL, "prompt": 3}), 400, "'prompt'"),
    (dict(json={"model": MODEL, "prompt": "a", "nonsense": 1}), 400, "'nonsense'"),
    (dict(json={"model": MODEL, "prompt": "a", "n": 9}), 400, "'n'"),
    (dict(json={"model": MODEL, "prompt": "a", "max_tokens": 99999}), 400, "max_seq_len"),
    (dict(json={"model": MODEL, "prompt": []}), 400, "non-empty"),   # "" is [BOS]: served
    (dict(json={"model": "gpt-4o", "prompt": "a"}), 404, "not found"),
    (dict(data=b"x" * (11 * 2**20)), 413, "over"),
])
def test_bad_inputs_get_4xx_openai_errors_and_the_server_serves_on(server, client, send,
                                                                   status, words):
    resp = requests.post(f"{server.front}/v1/completions", timeout=60,
                         headers={"Content-Type": "application/json", "X-Request-Id": "bad-1"},
                         **send)
    assert resp.status_code == status, resp.text
    assert words in resp.json()["error"]["message"]
    assert resp.headers["X-Request-Id"] == "bad-1"
    assert client.completions.create(model=MODEL, prompt="a", max_tokens=2).choices


def test_an_orchestrator_error_reaches_the_front_in_its_stream(server):
    """The orchestrator refuses an unsealed request (as it does a direct client's): the
    front's relay gets the code in the stream's error message and the stream ends as usual.
    Not Triton's ``triton_grpc_error`` mode, for which tritonserver 2.51 logs
    "HandleCancellation called even when the context was not cancelled" at each error and
    once crashed after it (front/orchestrator_call.py); then the server serves on."""
    import asyncio

    from triton_disagg.errors import ErrorCode
    from triton_disagg.front.orchestrator_call import OrchestratorError, Relay

    unsealed = {name: np.array(value, np.int32) for name, value in (   # [1, ...] each
        ("input_ids", [[5, 6, 7]]), ("input_lengths", [[3]]), ("request_output_len", [[2]]),
        ("stop_words_list", [[[0], [-1]]]), ("bad_words_list", [[[0], [-1]]]),
        ("end_id", [[-1]]), ("pad_id", [[0]]))}

    async def refused() -> OrchestratorError:
        relay = Relay(server.grpc)
        try:
            with pytest.raises(OrchestratorError) as err:
                async for _ in relay.stream(unsealed, "unsealed-1"):
                    pass
            return err.value
        finally:
            await relay.close()

    before = server.server_log().count("HandleCancellation called")
    for _ in range(3):
        error = asyncio.run(refused())
        assert error.code is ErrorCode.INVALID_ARG and "prepared" in str(error), error
        assert not str(error).startswith("[")                  # the code left the message
    time.sleep(2)                          # the server's notification of the stream's end
    assert server.server_log().count("HandleCancellation called") == before
    assert requests.post(f"{server.front}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "a", "max_tokens": 2}).status_code == 200


def test_tritons_own_stream_error_for_a_model_not_ready_is_unavailable(server, monkeypatch):
    """An error Triton itself puts on the stream (the model unknown: no ``[CODE] `` tag, no
    gRPC status) while the model is not ready is UNAVAILABLE (503 + Retry-After at the
    front), not INTERNAL: the relay asks Triton, never reads the message's words. The relay
    dials tritonserver's own port, as the front's does (the public door refuses a model that
    is not served before Triton sees it)."""
    import asyncio

    from triton_disagg.errors import ErrorCode
    from triton_disagg.front import orchestrator_call

    monkeypatch.setattr(orchestrator_call, "ORCHESTRATOR", "no_such_model")

    async def refused() -> orchestrator_call.OrchestratorError:
        inner = (f"{servers.tritonserver_flag(server.work_dir, 'grpc-address')}:"
                 f"{servers.tritonserver_flag(server.work_dir, 'grpc-port')}")
        relay = orchestrator_call.Relay(inner)
        try:
            with pytest.raises(orchestrator_call.OrchestratorError) as err:
                async for _ in relay.stream({"input_ids": np.array([[5]], np.int32)}, "r-1"):
                    pass
            return err.value
        finally:
            await relay.close()

    error = asyncio.run(refused())
    assert error.code is ErrorCode.UNAVAILABLE and error.status == 503, error
    assert "no_such_model" in str(error) and not str(error).startswith("[")


def test_sdk_raises_the_openai_error(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL, prompt="a", top_p=5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "a"}])


def _cancelled(served) -> float:
    from triton_disagg.routing.scrape import scrape, total

    return total(scrape(served.metrics), "disagg_requests_total", outcome="cancelled",
                 role="orchestrator")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_and_frees_its_blocks(server, stream):
    """The orchestrator counts the request ``cancelled`` (a request that ran to its 1500
    tokens counts ``finished``), and the KV blocks return to 0. Generous waits: the
    machine may be busy."""
    cancelled = _cancelled(server)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0,
            "stream": stream}
    if stream:
        with requests.post(f"{server.front}/v1/completions", stream=True, timeout=60,
                           json=body) as resp:
            lines = resp.iter_lines()
            for _ in range(3):
                line = next(line for line in lines if line)
                assert json.loads(line[len(b"data: "):])["choices"]
            servers.wait_until(lambda: blocks_used(server) > 0, 60,   # the gauge: every 0.5 s
                               "the request holds KV blocks")
    else:
        import http.client

        host, port = server.front.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        servers.wait_until(lambda: blocks_used(server) > 0, 60, "the request holds KV blocks")
        conn.close()                           # before any answer: the client is gone
    servers.wait_until(lambda: _cancelled(server) == cancelled + 1, 60,
                       "the orchestrator counts the request cancelled", poll=0.1)
    servers.wait_until(lambda: blocks_used(server) == 0, 60, "KV blocks back to 0", poll=0.1)


def test_bench_front_paths_send_the_same_requests(server, demo_engine):
    """`bench front`'s two senders against this server: every reply complete, with exactly
    its max_tokens tokens (end id off), over gRPC and over the front alike."""
    import math
    import random

    from triton_disagg.clients.load import run_load, run_openai_load
    from triton_disagg.clients.stream import GenerateRequest

    rng = random.Random(0)
    requests_ = [GenerateRequest(PROMPTS[i % len(PROMPTS)], rng.randint(4, 12), True,
                                 {"end_id": -1}) for i in range(6)]
    for run in (run_load(server.grpc, requests_, math.inf),
                run_openai_load(server.front, MODEL, requests_, math.inf)):
        assert [o.error for o in run.outcomes] == [None] * len(requests_)
        assert [o.measurement.output_tokens for o in run.outcomes] == \
            [r.max_tokens for r in requests_]
        assert all(o.measurement.ttft > 0 for o in run.outcomes)


def _front_argv(server, demo_engine, port: int) -> list[str]:
    import sys

    return [sys.executable, "-m", "triton_disagg.front.http_front", "--engine", str(demo_engine),
            "--model-name", MODEL, "--grpc-url", server.grpc, "--port", str(port)]


def _wait_healthy(url: str) -> None:
    def healthy() -> bool:
        try:
            return requests.get(f"{url}/healthz", timeout=1).status_code == 200
        except requests.ConnectionError:
            return False
    servers.wait_until(healthy, 60, f"{url}/healthz answers 200", poll=0.1)


def test_the_front_stops_cleanly_on_sigterm(server, demo_engine):
    import subprocess

    (port,) = servers.free_ports(1)
    proc = subprocess.Popen(_front_argv(server, demo_engine, port), stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}")
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_the_front_exits_when_its_parent_is_killed(server, demo_engine):
    """serve stops the front; should serve be SIGKILLed, the front notices and exits."""
    import os
    import signal
    import subprocess
    import sys

    (port,) = servers.free_ports(1)
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen({_front_argv(server, demo_engine, port)!r})\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    front = int(parent.stdout.readline())
    try:
        _wait_healthy(f"http://127.0.0.1:{port}")
        parent.kill()
        parent.wait()
        servers.wait_until(lambda: not os.path.exists(f"/proc/{front}") or
                           "zombie" in open(f"/proc/{front}/status").read(), 10,
                           "the front exits without its parent", poll=0.1)
    finally:
        parent.kill()
        if os.path.exists(f"/proc/{front}"):
            os.kill(front, signal.SIGKILL)

"""The scheduler's ``/healthz`` follows the roles it routes to (launch/roles_gate.py), on real
tritonservers: with no context or generation server running it says "up" but answers not
ready (and a request fails in one line naming the role and the url); once both roles
answer it turns ready within a few seconds and serves the offline engine's text; when the
generation server stops it turns not ready again, says why, and a request that got its
first token from context fails in one line naming generation and its url. The model-control
API is closed to clients.

Every role's ``/healthz`` (its HTTP front: the scheduler's whole front, context's and
generation's health-only one) follows the same: 503 with a reason, 200 ``{"status": "ok"}``
once the server can serve, 503 while its tritonserver does not answer (SIGSTOP), 200 again
after. A context server stopped (SIGSTOP) past the scheduler's deadline (``stall_seconds``)
is a timeout: 504 at the HTTP front, "timed out" over gRPC; once it
runs again (SIGCONT) the scheduler serves on."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from config_files import three_roles_config
import servers
from servers import wait_until

READY_BOUND = 10.0     # seconds: a check every second, plus a stub start to load the gate
# The scheduler's generation_server.stall_seconds: each call's deadline. Below the gRPC
# keepalive's 5 s ping timeout, so a stopped server's call ends at its deadline, not on a ping.
DEADLINE = 4


def _ready(front: str) -> bool:
    try:
        with urllib.request.urlopen(f"{front}/healthz", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _healthz(front: str) -> tuple[int, dict]:
    resp = requests.get(f"{front}/healthz", timeout=5)
    return resp.status_code, resp.json()


def _pids(served: servers.Served, word: str) -> list[int]:
    """The processes under ``served`` whose command line holds ``word``."""
    return [int(line.split(":")[0]) for line in servers.processes_under(served.work_dir)
            if word in line]


@contextlib.contextmanager
def _while_stopped(pids: list[int]):
    """SIGSTOP ``pids`` for the ``with`` block, SIGCONT after."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _every_role_answers_healthz(scheduler, context, generation) -> None:
    for served in (context, generation):
        assert _healthz(served.front) == (200, {"status": "ok"}), served.work_dir
        assert requests.get(f"{served.front}/health", timeout=5).status_code == 200
    wait_until(lambda: _healthz(scheduler.front)[0] == 200, READY_BOUND, "scheduler healthz")
    (tritonserver,) = _pids(context, "bin/tritonserver")
    with _while_stopped([tritonserver]):
        status, body = _healthz(context.front)
        assert status == 503 and "tritonserver does not answer" in body["reason"], body
    wait_until(lambda: _healthz(context.front)[0] == 200, READY_BOUND, "context healthz again")


def _a_context_past_its_deadline_is_a_timeout(scheduler, context, model: str, offline) -> None:
    """504 at the front, "timed out" over gRPC, then served on once the context runs. The
    context's tritonserver is stopped, not its stub: Triton fails a call to a stopped stub
    at once ("Stub process 'context_0_0' is not healthy", measured), a fault, not a timeout."""
    (tritonserver,) = _pids(context, "bin/tritonserver")
    with _while_stopped([tritonserver]), ThreadPoolExecutor(1) as pool:
        over_grpc = pool.submit(_one_line_error, scheduler.grpc, "The quick brown fox")
        begun = time.monotonic()
        resp = requests.post(f"{scheduler.front}/v1/completions", timeout=60, json={
            "model": model, "prompt": "The quick brown fox", "max_tokens": 8})
        took = time.monotonic() - begun
        error = resp.json()["error"]
        assert resp.status_code == 504 and error["code"] == "server_error", resp.text
        assert "timed out" in error["message"] and "127.0.0.1" not in error["message"], error
        assert DEADLINE - 1 < took < 4 * DEADLINE, took
        message = over_grpc.result(timeout=60)
        assert "timed out" in message and "context server" in _detail(scheduler, message)
    wait_until(lambda: _healthz(scheduler.front)[0] == 200, READY_BOUND, "ready again")
    text = requests.post(f"{scheduler.front}/v1/completions", timeout=60, json={
        "model": model, "prompt": "The quick brown fox", "max_tokens": 8,
        "temperature": 0})
    assert text.status_code == 200, text.text
    assert text.json()["choices"][0]["text"] == offline("The quick brown fox", 8)



def _detail(served: servers.Served, message: str) -> str:
    """The server log's line on the request that a client's error ``message`` names (the
    client is told only the error's kind and the request id)."""
    request_id = re.search(r"\(request (\S+);", message).group(1)

    def line() -> str:
        return next((text for text in served.server_log().splitlines()
                     if f"request {request_id}:" in text), "")
    wait_until(lambda: line(), 10, f"the log line of request {request_id}")
    return line()


def _one_line_error(grpc: str, prompt: str) -> str:
    with pytest.raises(RuntimeError) as failure:
        servers.grpc_stream(grpc, prompt, 8)
    message = str(failure.value)
    assert "\n" not in message.strip() and "Traceback" not in message, message
    return message


def test_ready_follows_the_roles_it_routes_to(demo_engine, tmp_path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    ctx_port, gen_port = servers.free_ports(2)
    config = three_roles_config(tmp_path, demo_engine, ctx_port, gen_port,
                                generation=f", stall_seconds: {DEADLINE}")
    offline = servers.offline_text(demo_engine)
    args = ["-c", str(config)]
    with servers.serve("scheduler", args, tmp_path / "s", until="up (") as scheduler:
        said = f"not ready: no context server in context_server.urls answers (127.0.0.1:{ctx_port})"
        seen = [_ready(scheduler.front) for _ in range(10) if not time.sleep(0.2)]
        wait_until(lambda: said in scheduler.log.read_text(), READY_BOUND, "it says why")
        seen.append(_ready(scheduler.front))
        assert not any(seen), "ready with no context or generation server"
        status, body = _healthz(scheduler.front)
        assert status == 503 and "has no server that answers" in body["reason"], body
        assert "ready (" not in scheduler.log.read_text()
        message = _one_line_error(scheduler.grpc, "The quick brown fox")
        assert "unavailable" in message and "127.0.0.1" not in message, message
        detail = _detail(scheduler, message)
        assert "context server" in detail and f"127.0.0.1:{ctx_port}" in detail, detail
        with grpcclient.InferenceServerClient(scheduler.grpc) as client:   # closed to clients
            with pytest.raises(InferenceServerException, match="not allowed"):
                client.load_model("ensemble")

        with servers.serve("context", args, tmp_path / "c", http=False,
                           grpc_port=ctx_port) as ctx, \
                servers.serve("generation", args, tmp_path / "g", http=False,
                              grpc_port=gen_port) as gen:
            took = wait_until(lambda: _ready(scheduler.front), READY_BOUND, "ready once peers answer")
            print(f"ready {took:.1f} s after both peers were")
            wait_until(lambda: "ready (every role has a server that answers)"
                   in scheduler.log.read_text(), 2, "it says so")
            for prompt in servers.PROMPTS[:2]:
                status, body = servers.generate(scheduler.http,
                                                {"text_input": prompt, "max_tokens": 16})
                assert status == 200 and body["text_output"] == offline(prompt, 16), body
            _every_role_answers_healthz(scheduler, ctx, gen)
            _a_context_past_its_deadline_is_a_timeout(scheduler, ctx, demo_engine.name, offline)
            assert servers.stop(gen) == 0
            wait_until(lambda: not _ready(scheduler.front), READY_BOUND, "not ready once gen left")
            assert _healthz(scheduler.front)[0] == 503
            said = (f"not ready: no generation server in generation_server.urls answers "
                    f"(127.0.0.1:{gen_port})")
            wait_until(lambda: said in scheduler.log.read_text(), READY_BOUND, "it says why")
            message = _one_line_error(scheduler.grpc, "The quick brown fox")
            assert "unavailable" in message and "127.0.0.1" not in message, message
            detail = _detail(scheduler, message)
            assert "generation server" in detail and f"127.0.0.1:{gen_port}" in detail, detail

"""The scheduler's ``/v2/health/ready`` follows its peers (launch/peers_gate.py), on real
tritonservers: with no context or generation server running it says "up" but answers not
ready (and a request fails in one line naming the role and the url); once both roles
answer it turns ready within a few seconds and serves the offline engine's text; when the
generation server stops it turns not ready again, says why, and a request that got its
first token from context fails in one line naming generation and its url. The model-control
API that the gate uses is closed to clients."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest

from config_files import three_roles_config
import servers
from servers import wait_until

READY_BOUND = 10.0     # seconds: a check every second, plus a stub start to load the gate


def _ready(http: str) -> bool:
    try:
        with urllib.request.urlopen(f"{http}/v2/health/ready", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False




def _one_line_error(grpc: str, prompt: str) -> str:
    with pytest.raises(RuntimeError) as failure:
        servers.grpc_stream(grpc, prompt, 8)
    message = str(failure.value)
    assert "\n" not in message.strip() and "Traceback" not in message, message
    return message


def test_ready_follows_the_peers(demo_engine, tmp_path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    ctx_port, gen_port = servers.free_ports(2)
    config = three_roles_config(tmp_path, demo_engine, ctx_port, gen_port)
    offline = servers.offline_text(demo_engine)
    args = ["-c", str(config)]
    with servers.serve("scheduler", args, tmp_path / "s", until="up (") as scheduler:
        said = f"not ready: no context server in context_server.urls answers (127.0.0.1:{ctx_port})"
        seen = [_ready(scheduler.http) for _ in range(10) if not time.sleep(0.2)]
        wait_until(lambda: said in scheduler.log.read_text(), READY_BOUND, "it says why")
        seen.append(_ready(scheduler.http))
        assert not any(seen), "ready with no context or generation server"
        assert "ready (" not in scheduler.log.read_text()
        message = _one_line_error(scheduler.grpc, "The quick brown fox")
        assert "context server" in message and f"127.0.0.1:{ctx_port}" in message, message
        with grpcclient.InferenceServerClient(scheduler.grpc) as client:   # closed to clients
            with pytest.raises(InferenceServerException, match="restricted"):
                client.unload_model("peers_ready")

        with servers.serve("context", args, tmp_path / "c", http=False, grpc_port=ctx_port), \
                servers.serve("generation", args, tmp_path / "g", http=False,
                              grpc_port=gen_port) as gen:
            took = wait_until(lambda: _ready(scheduler.http), READY_BOUND, "ready once peers answer")
            print(f"ready {took:.1f} s after both peers were")
            wait_until(lambda: "ready (every role has a server that answers)"
                   in scheduler.log.read_text(), 2, "it says so")
            for prompt in servers.PROMPTS[:2]:
                status, body = servers.generate(scheduler.http,
                                                {"text_input": prompt, "max_tokens": 16})
                assert status == 200 and body["text_output"] == offline(prompt, 16), body
            assert servers.stop(gen) == 0
            wait_until(lambda: not _ready(scheduler.http), READY_BOUND, "not ready once gen left")
            said = (f"not ready: no generation server in generation_server.urls answers "
                    f"(127.0.0.1:{gen_port})")
            wait_until(lambda: said in scheduler.log.read_text(), READY_BOUND, "it says why")
            message = _one_line_error(scheduler.grpc, "The quick brown fox")
            assert "generation server" in message and f"127.0.0.1:{gen_port}" in message, message

"""Who may call what (docs/architecture.md, "Trust boundaries"), on real servers.

``serve all``: a client that calls ``context`` or ``generation`` itself (no peer
credential, or a wrong one) gets a one-line error and no ``context_phase_params``, while
the ensemble answers; Triton's shared-memory, logging and trace APIs refuse it over HTTP
and gRPC while health and inference work. ``serve scheduler`` with two context servers,
one SIGSTOPped: every request completes through the other within the deadline
(``generation_server.stall_seconds``) plus its own run time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import servers
from servers import PROMPTS
from triton_disagg.routing.scrape import scrape, total

STALL_SECONDS = 4


@pytest.fixture(scope="module")
def served(demo_engine, tmp_path_factory):
    work = tmp_path_factory.mktemp("trust")
    with servers.serve_config(f"model: {{engine: {demo_engine}}}\n"
                              "kv_cache: {strategy: host_memory, max_size: 16MB}\n",
                              work) as server:
        yield server


def _generation_inputs():
    import tritonclient.grpc as grpcclient

    arrays = {"input_ids": np.array([[3, 4, 5, 6]], np.int32),
              "input_lengths": np.array([[4]], np.int32),
              "request_output_len": np.array([[4]], np.int32),
              "context_phase_params": np.zeros((1, 8), np.uint8)}
    tensors = []
    for name, arr in arrays.items():
        tensors.append(grpcclient.InferInput(name, list(arr.shape),
                                             grpcclient.np_to_triton_dtype(arr.dtype)))
        tensors[-1].set_data_from_numpy(arr)
    return tensors


@pytest.mark.parametrize("credential", [None, "0" * 64])
@pytest.mark.parametrize("model", ["context", "generation"])
def test_a_client_cannot_call_context_or_generation(served, offline_demo, model, credential):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from triton_disagg import protocol as P
    from triton_disagg.triton.tensors import peer_credential

    params = {"request_type": "context_only" if model == "context" else "generation_only"}
    if model == "generation":
        params["token_address"] = "tcp://127.0.0.1:1"
    if credential is not None:
        params[P.PEER_CREDENTIAL] = credential
    tensors = (servers.orchestrator_inputs(list(range(3, 40)), 8)[:3] if model == "context"
               else _generation_inputs())
    with grpcclient.InferenceServerClient(served.grpc) as client:
        with pytest.raises(InferenceServerException) as err:
            client.infer(model, tensors, request_id="client-1", parameters=params)
    message = err.value.message()
    assert "\n" not in message and P.PEER_CREDENTIAL in message and "ensemble" in message, message
    assert peer_credential() not in message
    status, body = servers.generate(served.http, {"text_input": PROMPTS[0], "max_tokens": 8})
    assert status == 200 and body["text_output"] == offline_demo(PROMPTS[0], 8), body


@pytest.fixture(scope="module")
def offline_demo(demo_engine):
    return servers.offline_text(demo_engine)


def _http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_apis_clients_do_not_need_are_restricted(served):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    for path in ("/v2/logging", "/v2/trace/setting", "/v2/systemsharedmemory/status",
                 "/v2/cudasharedmemory/status"):
        status, body = _http(served.http + path)
        assert status != 200 and "restricted" in body, (path, status, body)
    assert _http(served.http + "/v2/health/ready")[0] == 200
    assert _http(served.http + "/v2/models/ensemble")[0] == 200
    with grpcclient.InferenceServerClient(served.grpc) as client:
        for call in (client.get_log_settings, client.get_trace_settings,
                     client.get_system_shared_memory_status):
            with pytest.raises(InferenceServerException, match="restricted"):
                call()
        assert client.is_server_ready()


def test_a_stopped_context_server_is_left_for_another_within_the_deadline(demo_engine,
                                                                          tmp_path,
                                                                          offline_demo):
    a, b, gen = servers.free_ports(3)
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\n"
                      "kv_cache: {strategy: direct_transfer, max_size: 16MB}\n"
                      f'context_server: {{urls: ["localhost:{a}", "localhost:{b}"]}}\n'
                      f'generation_server: {{url: "localhost:{gen}", '
                      f"stall_seconds: {STALL_SECONDS}}}\n")
    args = ["-c", str(config)]
    with contextlib.ExitStack() as stack:
        stopped = stack.enter_context(servers.serve("context", args, tmp_path / "a",
                                                    http=False, grpc_port=a))
        stack.enter_context(servers.serve("context", args, tmp_path / "b", http=False,
                                          grpc_port=b))
        stack.enter_context(servers.serve("generation", args, tmp_path / "g", http=False,
                                          grpc_port=gen))
        scheduler = stack.enter_context(servers.serve("scheduler", args, tmp_path / "s"))
        pid = servers.tritonserver_pid(stopped.work_dir)
        os.killpg(pid, signal.SIGSTOP)
        stack.callback(os.killpg, pid, signal.SIGCONT)      # before its serve stops it
        for prompt in PROMPTS[:3]:
            began = time.monotonic()
            status, body = servers.generate(scheduler.http, {"text_input": prompt,
                                                             "max_tokens": 8})
            took = time.monotonic() - began
            assert status == 200 and body["text_output"] == offline_demo(prompt, 8), body
            assert took < STALL_SECONDS + 10, (prompt, took)
        retried = total(scrape(scheduler.metrics), "disagg_route_retries_total",
                        server=f"localhost:{a}")
        assert retried >= 1, "no request went to the stopped server"


def _orchestrator_call(grpc: str, tensors: list, timeout: float = 60.0) -> list:
    """One request streamed to the orchestrator; its responses until the final one, or the
    error's message (a str)."""
    import queue

    import tritonclient.grpc as grpcclient

    got: queue.Queue = queue.Queue()
    responses = []
    with grpcclient.InferenceServerClient(grpc) as client:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer("orchestrator", tensors, enable_empty_final_response=True)
        while True:
            result, error = got.get(timeout=timeout)
            if error is not None:
                client.stop_stream()
                return error.message()
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    return responses


def test_a_client_cannot_call_the_orchestrator_directly(served, offline_demo):
    from triton_disagg import protocol as P

    ids = list(range(3, 40))

    def forged():
        tensors = servers.orchestrator_inputs(ids, 8)
        tensors[-1].set_data_from_numpy(np.zeros((1, 32), np.uint8))     # the seal, zeroed
        return tensors

    for tensors in (lambda: servers.orchestrator_inputs(ids, 8, sealed=False), forged):
        message = _orchestrator_call(served.grpc, tensors())
        assert isinstance(message, str), "the orchestrator served an unsealed request"
        assert "\n" not in message and P.PREPROCESSED in message and "ensemble" in message
    sealed = _orchestrator_call(served.grpc, servers.orchestrator_inputs(ids, 8))
    assert not isinstance(sealed, str), sealed                            # as the front does
    assert sum(int(r.as_numpy("num_output_tokens").reshape(-1)[-1]) > 0 for r in sealed)
    status, body = servers.generate(served.http, {"text_input": PROMPTS[0], "max_tokens": 8})
    assert status == 200 and body["text_output"] == offline_demo(PROMPTS[0], 8), body


def test_model_configs_show_clients_no_settings_or_topology(served, demo_engine):
    for model in ("orchestrator", "preprocessing", "context", "generation"):
        status, body = _http(f"{served.http}/v2/models/{model}/config")
        assert status == 200, (model, body)
        config = json.loads(body)
        assert "settings" not in config.get("parameters", {}), (model, config["parameters"])
        assert str(demo_engine) not in body and "stall_seconds" not in body, (model, body)

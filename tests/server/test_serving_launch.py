"""launch/: rendering repositories, binding rules, and a real tritonserver's start and stop."""

from __future__ import annotations

import argparse
import json
import os
import textwrap
import urllib.request
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

import servers
from triton_disagg import protocol as P
from triton_disagg.config.disagg import parse_config
from triton_disagg.errors import UserError
from triton_disagg.launch.deploy import PortFlags, advertised_url, endpoints_for, token_host
from triton_disagg.launch import serve_cli
from triton_disagg.triton.render import render
from triton_disagg.triton.tritonserver import TritonServer, locate
from triton_disagg.triton.endpoints import Endpoints


@pytest.fixture
def config(tmp_path):
    (tmp_path / "engine.json").write_text("{}")
    return parse_config({
        "model": {"engine": str(tmp_path)},
        "context_server": {"url": "localhost:9001", "cpus": [0, 1], "instances": 2},
        "generation_server": {"url": "localhost:9002", "instances": 1, "tokens_per_block": 8},
        "kv_cache": {"strategy": "host_memory", "max_size": "64MiB"}})


def _load(repo: Path, model: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse((repo / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


@pytest.mark.parametrize("role, models", [
    ("all", {"ensemble", "preprocessing", "orchestrator", "context", "context_1", "generation"}),
    ("scheduler", {"ensemble", "preprocessing", "orchestrator"}),
    ("context", {"context", "context_1"}), ("generation", {"generation"})])
def test_render_roles(config, tmp_path, role, models):
    repo = render(role, config, tmp_path / "repo")
    assert {p.name for p in repo.iterdir()} == models
    for model in models:
        cfg = _load(repo, model)          # valid protobuf text
        assert cfg.max_batch_size == P.MAX_BATCH_SIZE
        if model != "ensemble":
            assert (repo / model / "1" / "model.py").is_file()


def test_rendered_tensors_and_settings_come_from_protocol(config, tmp_path):
    repo = render("all", config, tmp_path / "repo")
    ens = _load(repo, "ensemble")
    assert [(i.name, i.optional) for i in ens.input] == [(s.name, s.optional) for s in P.ENSEMBLE_INPUTS]
    assert {o.name for o in ens.output} == {s.name for s in P.ENSEMBLE_OUTPUTS}
    produced = {v for step in ens.ensemble_scheduling.step for v in step.output_map.values()}
    assert {s.name for s in P.ENSEMBLE_OUTPUTS} <= produced
    ctx = _load(repo, "context")
    assert ctx.input[0].allow_ragged_batch and ctx.dynamic_batching is not None
    # one model per context instance (a router's pick is the model it calls), each on its cores
    assert [_load(repo, m).instance_group[0].count for m in ("context", "context_1")] == [1, 1]
    settings = json.loads((repo / "context" / "settings.json").read_text())
    assert settings["instance_cpus"] == [[0]] and settings["kv_strategy"] == "host_memory"
    assert json.loads((repo / "context_1" / "settings.json").read_text())["instance_cpus"] == [[1]]
    assert not _load(repo, "generation").model_transaction_policy.decoupled   # one ack each
    orch = json.loads((repo / "orchestrator" / "settings.json").read_text())
    assert orch["transport"] == "bls" and orch["token_host"] is None      # ipc on one host
    assert orch["stall_seconds"] == 30.0
    assert _load(repo, "orchestrator").instance_group[0].count == 1
    two = parse_config({"model": {"engine": str(config.engine)},
                        "scheduler_server": {"instances": 2}})
    assert _load(render("all", two, tmp_path / "two"), "orchestrator").instance_group[0].count == 2
    scheduler = render("scheduler", config, tmp_path / "s", "10.1.2.3")
    orch = json.loads((scheduler / "orchestrator" / "settings.json").read_text())
    assert orch["transport"] == "grpc" and orch["discovery"] is None
    pool = orch["pools"]["generation"]
    assert (pool["urls"], pool["router"]) == (["localhost:9002"], "least_loaded")
    assert orch["max_local_prefill_length"] == 0
    assert orch["token_host"] == "10.1.2.3"          # tcp: generation may be on another host
    # the topology stays out of the config Triton shows clients; the file is private
    assert "localhost:9002" not in (scheduler / "orchestrator" / "config.pbtxt").read_text()
    assert (scheduler / "orchestrator" / "settings.json").stat().st_mode & 0o777 == 0o600


def test_aggregated_renders_no_context(config, tmp_path):
    from dataclasses import replace

    repo = render("all", replace(config, mode="aggregated"), tmp_path / "repo")
    assert not (repo / "context").exists()


def test_binding(config):
    assert endpoints_for("all", config, PortFlags()) == Endpoints("127.0.0.1", 8000, 8001, 8002)
    assert endpoints_for("context", config, PortFlags()) == Endpoints("127.0.0.1", None, 9001, None)
    assert endpoints_for("context", config, PortFlags(host="0.0.0.0", metrics=9100)).metrics_port == 9100
    with pytest.raises(UserError, match="ports collide"):
        endpoints_for("all", config, PortFlags(http=8001))


def test_advertised_address_and_token_hosts(config):
    from dataclasses import replace

    def advertised(cfg, **flags):
        flags = PortFlags(**flags)
        return advertised_url("generation", cfg, endpoints_for("generation", cfg, flags), flags)

    assert advertised(config) == "127.0.0.1:9002"                     # what it binds
    assert advertised(config, host="0.0.0.0", grpc=7000) == "localhost:7000"   # url's host
    assert advertised(config, host="0.0.0.0", advertise="gen-01:9") == "gen-01:9"
    with pytest.raises(UserError, match="--advertise HOST:PORT"):
        advertised(replace(config, generation=replace(config.generation, url=None)),
                   host="0.0.0.0")
    assert token_host("generation", config, "10.0.0.5:9002") == "10.0.0.5"
    assert token_host("scheduler", config, None) == "127.0.0.1"      # route to generation's host
    assert token_host("all", config, None) is None                    # ipc
    pool = replace(config, generation=replace(config.generation, url=None,
                                              urls=("127.0.0.1:9002", "localhost:9003")))
    assert token_host("scheduler", pool, None) == "127.0.0.1"        # the same route to each
    args = argparse.Namespace(role="all", config=None, engine=config.engine, advertise="a:1",
                              gpus=None, overlap_kv_transfer=False, served_model_name=None)
    with pytest.raises(UserError, match="--advertise: serve all advertises nothing"):
        serve_cli.load(args)


def test_the_schedulers_token_socket_faces_every_generation_server(config):
    """Pools: the route to each generation url must leave from one address (the socket
    has one); with discovery and no urls, the route to etcd's host, which every server
    reaches too."""
    from dataclasses import replace

    from triton_disagg.config.discovery_section import DiscoveryConfig

    ip = _an_address_of_this_host()
    pool = replace(config, generation=replace(config.generation, url=None,
                                              urls=("127.0.0.1:9002", f"{ip}:9003")))
    with pytest.raises(UserError, match=r"^generation_server.urls: this host reaches "
                                        r"127.0.0.1:9002 from 127.0.0.1, .* one address"):
        token_host("scheduler", pool, None)
    discovered = replace(config, generation=replace(config.generation, url=None, urls=()),
                         discovery=DiscoveryConfig(etcd=f"{ip}:2379"))
    assert token_host("scheduler", discovered, None) == ip
    loopback_etcd = replace(discovered, discovery=DiscoveryConfig(etcd="localhost:2379"))
    assert token_host("scheduler", loopback_etcd, None) == "127.0.0.1"


def _an_address_of_this_host() -> str:
    """A non-loopback address of this host (the route toward a public address)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(("192.0.2.1", 9))     # TEST-NET-1: a UDP connect sends nothing
        return sock.getsockname()[0]


@pytest.mark.parametrize("yaml, words", [
    ("", ["context_server.url", "missing", "urls: [...]", "discovery"]),
    ("mode: aggregated\n", ["generation_server.url", "missing"]),
])
def test_a_scheduler_without_servers_to_route_to_is_one_line(tmp_path, yaml, words):
    (tmp_path / "engine.json").write_text("{}")
    path = tmp_path / "disagg_config.yaml"
    path.write_text(f"model: {{engine: {tmp_path}}}\n{yaml}")
    args = argparse.Namespace(role="scheduler", config=path, engine=None, advertise=None,
                              gpus=None, overlap_kv_transfer=False, served_model_name=None)
    with pytest.raises(UserError) as err:
        serve_cli.load(args)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), err.value
    path.write_text(f"model: {{engine: {tmp_path}}}\n{yaml}discovery: {{etcd: 'e:2379'}}\n")
    assert serve_cli.load(args).discovery is not None             # etcd names the servers


def test_override_must_be_a_binary(tmp_path):
    with pytest.raises(UserError, match="--tritonserver"):
        locate(tmp_path / "nope")


ECHO = textwrap.dedent('''
    import os
    import triton_python_backend_utils as pb_utils
    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 0 + os.getpid())]))
            return out
''')


def test_embedded_tritonserver_starts_serves_and_stops_its_whole_group(tmp_path):
    repo = tmp_path / "repo"
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "1" / "model.py").write_text(ECHO)
    (repo / "echo" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_INT64 dims: [ 1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_INT64 dims: [ 1 ] } ]\n')
    http, grpc, metrics = servers.free_ports(3)
    server = TritonServer(locate(), repo, Endpoints("127.0.0.1", http, grpc, metrics), tmp_path)
    server.start()
    try:
        assert server.wait_ready(timeout=120)
        body = json.dumps({"inputs": [{"name": "X", "datatype": "INT64", "shape": [1], "data": [0]}]})
        with urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{http}/v2/models/echo/infer", data=body.encode())) as resp:
            stub_pid = json.loads(resp.read())["outputs"][0]["data"][0]
        assert os.getpgid(stub_pid) == server.process.pid      # the stub is in the server's group
        assert "triton_python_backend_stub" in Path(f"/proc/{stub_pid}/cmdline").read_text()
    finally:
        server.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(server.process.pid, 0)


def test_serve_cli_stops_everything_on_sigterm_and_even_on_sigkill(demo_engine, tmp_path):
    import time

    with servers.serve("generation", ["--engine", str(demo_engine)], tmp_path / "a") as served:
        assert "the scheduler dials" in served.log.read_text()
    # stop() asserted that tritonserver and the stubs are gone; now kill -9 the CLI
    with servers.serve("generation", ["--engine", str(demo_engine)], tmp_path / "b") as served:
        served.process.kill()
        served.process.wait()
        deadline = time.monotonic() + 30
        while servers.processes_under(served.work_dir):
            assert time.monotonic() < deadline, servers.processes_under(served.work_dir)
            time.sleep(0.2)


def test_serve_all_stops_without_a_stub_crash(demo_engine, tmp_path):
    """Every model unloads on SIGTERM and no stub crashes while tearing down (the models
    enable faulthandler, so a crash would print "Fatal Python error" into the server log;
    custom metrics still alive at teardown crashed Triton 2.51's stubs)."""
    with servers.serve("all", ["--engine", str(demo_engine)], tmp_path) as served:
        status, body = servers.generate(served.http, {"text_input": "hello", "max_tokens": 4})
        assert status == 200, body
        assert servers.stop(served) == 0
        text = served.server_log()
    assert "Fatal Python error" not in text, text[-3000:]
    for model in ("preprocessing", "orchestrator", "context", "generation"):
        assert f"successfully unloaded '{model}'" in text, text[-3000:]


def test_serve_refuses_a_kv_pool_too_small_for_one_sequence_before_triton_starts(demo_engine,
                                                                                 tmp_path):
    import subprocess
    import sys

    config = tmp_path / "small.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\nkv_cache: {{max_size: 100KB}}\n")
    out = subprocess.run([sys.executable, "-m", "triton_disagg.cli", "serve", "all", "-c",
                          str(config), "--work-dir", str(tmp_path / "w")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "kv_cache.max_size" in out.stderr and "raise kv_cache.max_size" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "w" / "tritonserver.log").exists()

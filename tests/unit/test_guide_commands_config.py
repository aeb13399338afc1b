"""The guide's commands' config side: the guide's own ``disagg_config.yaml``
(tests/support/guide_disagg_config.yaml) loads with the engine given by ``--engine``, and its
three servers' ports share one host; the served model name (``model.name``,
``--served-model-name``); ``serve context|generation --gpus 0,1`` replaces the role's
placement (GPUs this host lacks: one line naming the flag); TensorRT-LLM's disaggregated
config loads, mapped onto ours (``port``: the OpenAI front's), with one line per key we do
not support."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from config_files import assert_one_line_error, config_writer
from triton_disagg.config.disagg import load_config
from triton_disagg.config.host import with_gpus_flag
from triton_disagg.errors import UserError
from triton_disagg.launch import serve_cli
from triton_disagg.launch.deploy import PortFlags, endpoints_for
from triton_disagg.launch.front_process import front_port
from triton_disagg.triton.endpoints import Endpoints

GUIDE = Path(__file__).resolve().parents[1] / "support" / "guide_disagg_config.yaml"

OURS = """\
model: {engine: engines/demo}
context_server:    {url: "127.0.0.1:9001", cpus: [0]}
generation_server: {url: "127.0.0.1:9002", cpus: [1]}
"""

TRTLLM = """\
hostname: localhost
port: 8000
backend: pytorch
model: {engine: engines/demo}
context_servers:
  num_instances: 2
  urls: ["ctx-01:8001", "ctx-02:8001"]
  max_batch_size: 16
  kv_cache_config: {tokens_per_block: 32, free_gpu_memory_fraction: 0.2}
  cache_transceiver_config: {backend: UCX}
generation_servers:
  num_instances: 1
  urls: ["gen-01:8002"]
  router: {type: load_balancing}
  tensor_parallel_size: 1
conditional_disagg_config: {max_local_prefill_length: 64}
otlp_config: {otlp_traces_endpoint: "http://collector:4318"}
"""


@pytest.fixture
def write(tmp_path):
    return config_writer(tmp_path)


def _engine(tmp_path: Path, name: str = "demo") -> Path:
    """A stand-in engine directory (the config checks the path, not the weights)."""
    engine = tmp_path / "engines" / name
    engine.mkdir(parents=True)
    (engine / "engine.json").write_text("{}")
    return engine


def test_the_guides_config_loads_with_the_engine_from_the_command_line(tmp_path):
    engine = _engine(tmp_path)
    config = load_config(GUIDE, engine=engine)
    assert config.engine == engine.resolve() and config.served_model_name == "demo"
    assert config.context.url == "context-server-01:8000" and config.context.gpus == (0, 1)
    assert config.generation.gpus == (2, 3) and config.kv_cache.max_size == 2 * 10**9
    with pytest.raises(UserError) as err:            # neither model.engine nor --engine
        load_config(GUIDE)
    message = str(err.value)
    assert "\n" not in message and "model.engine: missing" in message and "--engine" in message
    with pytest.raises(UserError, match="--engine: .* has no engine.json"):
        load_config(GUIDE, engine=tmp_path / "nowhere")


def test_the_guides_three_servers_share_one_host_on_its_ports(tmp_path):
    """Context 8000, generation 8001 (their urls), the scheduler's front 8002 (its url: the
    guide's verification request goes there), its tritonserver 8003-8005: no port twice."""
    config = load_config(GUIDE, engine=_engine(tmp_path))
    here = PortFlags(host="127.0.0.1")       # the guide's hosts on one host
    roles = ("context", "generation", "scheduler")
    triton = {role: endpoints_for(role, config, here) for role in roles}
    fronts = {role: front_port(role, config, None) for role in roles}
    assert [triton[role].grpc_port for role in roles[:2]] == [8000, 8001]
    assert fronts["scheduler"] == 8002
    assert triton["scheduler"] == Endpoints("127.0.0.1", 8003, 8004, 8005)
    taken = [p for e in triton.values() for p in (e.http_port, e.grpc_port, e.metrics_port)
             if p is not None] + list(fronts.values())
    assert len(set(taken)) == len(taken) and set(range(8000, 8006)) <= set(taken), taken
    # the scheduler's own ports follow the deployment's last port, wherever that is
    assert endpoints_for("scheduler", config, PortFlags(host="127.0.0.1", front=9000)) == \
        Endpoints("127.0.0.1", 9001, 9002, 9003)
    assert endpoints_for("scheduler", config, PortFlags(host="127.0.0.1", front=7000)) == \
        Endpoints("127.0.0.1", 8002, 8003, 8004)          # after generation's 8001
    with pytest.raises(UserError, match="past 65535.*--http-port"):
        endpoints_for("scheduler", config, PortFlags(host="127.0.0.1", front=65534))


def test_the_readmes_port_table_is_what_serve_opens(tmp_path, write):
    """README "Ports": per server, the front's port and tritonserver's HTTP, gRPC and metrics
    (the last number of a cell; "off": none) as serve opens them: serve all with a plain
    config, the three roles with the guide's."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = re.split(r"^#+ Ports\n", readme, flags=re.M)[1].split("\n\n", 1)[0].strip()
    shown = {}
    for row in table.splitlines()[2:]:
        server, *cells = [cell.strip() for cell in row.strip("|").split("|")]
        shown[server.strip("`").split()[1]] = [
            int(re.findall(r"\d+", cell)[-1]) if cell != "off" else None for cell in cells]
    guide, plain = load_config(GUIDE, engine=_engine(tmp_path / "g")), load_config(write(OURS))
    opened = {}
    for role in ("all", "scheduler", "context", "generation"):
        config = plain if role == "all" else guide
        e = endpoints_for(role, config, PortFlags(host="127.0.0.1"))
        opened[role] = [front_port(role, config, None), e.http_port, e.grpc_port, e.metrics_port]
    assert shown == opened


def test_served_model_name_from_the_config_or_the_flag(write, tmp_path):
    named = load_config(write(OURS.replace("{engine: engines/demo}",
                                           "{engine: engines/demo, name: deepseek-r1}")))
    assert named.served_model_name == "deepseek-r1" and named.engine.name == "demo"
    assert load_config(write(OURS)).served_model_name == "demo"     # the engine's folder

    def load(name):
        return serve_cli.load(argparse.Namespace(
            role="scheduler", config=GUIDE, engine=tmp_path / "engines" / "demo",
            served_model_name=name, gpus=None, overlap_kv_transfer=False, advertise=None))
    assert load("deepseek-r1").served_model_name == "deepseek-r1"
    assert load(None).served_model_name == "demo"
    with pytest.raises(UserError, match="^--served-model-name: 'a b' must be a name"):
        load("a b")


@pytest.mark.parametrize("name", ["''", "'a b'", "5", "'" + "x" * 257 + "'", "[a]"])
def test_a_bad_model_name_is_one_line(write, name):
    assert_one_line_error(write(f"model: {{engine: engines/demo, name: {name}}}\n"),
                          ["model.name", "printable"])


def test_gpus_flag_replaces_the_roles_placement(write):
    config = load_config(write(OURS))
    placed = with_gpus_flag(config, "generation", "0,1", gpu_count=2)
    assert placed.generation.gpus == (0, 1) and placed.generation.instances == 2
    assert placed.generation.cpus == () and placed.generation.url == "127.0.0.1:9002"
    assert placed.context == config.context


def test_gpus_flag_on_a_host_without_them_is_one_line_naming_the_flag(write):
    config = load_config(write(OURS))
    with pytest.raises(UserError) as err:
        with_gpus_flag(config, "context", "0,1", gpu_count=0)
    message = str(err.value)
    assert "\n" not in message and message.startswith("--gpus 0,1:") and "no GPUs" in message


@pytest.mark.parametrize("role, spec, words", [
    ("scheduler", "0", ["--gpus", "serve scheduler"]),
    ("all", "0", ["--gpus", "context_server.gpus"]),
    ("context", "0,0", ["--gpus", "distinct"]),
    ("context", "a", ["--gpus", "e.g. --gpus 0,1"]),
])
def test_gpus_flag_mistakes(write, role, spec, words):
    config = load_config(write(OURS))
    with pytest.raises(UserError) as err:
        with_gpus_flag(config, role, spec, gpu_count=8)
    for word in words:
        assert word in str(err.value)


def test_trtllm_format_maps_onto_ours(write, capsys):
    config = load_config(write(TRTLLM))
    assert config.context.urls == ("ctx-01:8001", "ctx-02:8001")
    assert config.context.tokens_per_block == 32
    assert config.generation.url == "gen-01:8002" and config.generation.router == "least_loaded"
    assert config.generation.max_local_prefill_length == 64
    # port: the OpenAI front's, as trtllm-serve's; tritonserver's own after the urls' 8002
    assert config.scheduler.url == "localhost:8000" and config.scheduler.http_port is None
    assert front_port("scheduler", config, None) == 8000
    assert endpoints_for("scheduler", config, PortFlags()) == \
        Endpoints("127.0.0.1", 8003, 8004, 8005)
    lines = capsys.readouterr().err.splitlines()
    assert all(line.split(": ")[0].endswith("disagg_config.yaml") for line in lines), lines
    said = {line.split(": ", 2)[1] for line in lines}
    assert said == {"backend", "otlp_config", "context_servers.max_batch_size",
                    "context_servers.kv_cache_config.free_gpu_memory_fraction",
                    "context_servers.cache_transceiver_config"}, lines
    assert any(line.endswith("one value for every role: kv_cache.gpu_memory_fraction")
               for line in lines), lines


@pytest.mark.parametrize("context, generation, ours, said", [
    ("true", "true", True, []), ("false", None, False, []),
    ("true", "false", False, ["kv_cache_config.enable_block_reuse differs"]),
    (None, None, True, [])])
def test_trtllm_enable_block_reuse_maps_to_prefix_caching(write, capsys, context, generation,
                                                          ours, said):
    def section(value):
        return "" if value is None else f", kv_cache_config: {{enable_block_reuse: {value}}}"

    config = load_config(write(f"model: {{engine: engines/demo}}\n"
                               f"context_servers: {{urls: [\"c:1\"]{section(context)}}}\n"
                               f"generation_servers: {{urls: [\"g:1\"]{section(generation)}}}\n"))
    assert config.kv_cache.prefix_caching is ours
    lines = capsys.readouterr().err.splitlines()
    assert [w for w in said if not any(w in line for line in lines)] == [] and \
        len(lines) == len(said), lines


def test_trtllm_disagg_cluster_becomes_discovery(write):
    config = load_config(write("model: {engine: engines/demo}\n"
                               "disagg_cluster: {cluster_uri: \"etcd://etcd-0:2379\", "
                               "cluster_name: prod}\n"
                               "context_servers: {num_instances: 1}\n"
                               "generation_servers: {num_instances: 1}\n"))
    assert config.discovery.etcd == "etcd-0:2379"
    assert config.discovery.prefix == "/triton-disagg/prod"


@pytest.mark.parametrize("kind", ["kv_cache_aware", "conversation"])
def test_trtllm_kv_aware_router_types_map_to_kv_aware(write, kind, capsys):
    config = load_config(write("model: {engine: engines/demo}\n"
                               f"context_servers: {{urls: [\"c:1\"], router: {{type: {kind}}}}}\n"
                               "generation_servers: {urls: [\"g:1\"]}\n"))
    assert config.context.router == "kv_aware"
    assert "router" not in capsys.readouterr().err      # supported: nothing said


@pytest.mark.parametrize("text, words", [
    ("hostname: localhost\ncontext_servers: {urls: [\"c:1\"]}\n", ["model", "engine"]),
    ("model: {engine: engines/demo}\ncontext_servers: {num_instances: 2, urls: [\"c:1\"]}\n",
     ["context_servers.num_instances", "one url per instance"]),
    ("model: {engine: engines/demo}\ngeneration_servers: {urls: [\"g:1\"], "
     "tensor_parallel_size: 2}\n", ["generation_servers.tensor_parallel_size", "2"]),
    ("model: {engine: engines/demo}\ndisagg_cluster: {cluster_uri: \"http://h:1\"}\n",
     ["disagg_cluster.cluster_uri", "etcd://"]),
    ("model: {engine: engines/demo}\ncontext_servers: {urls: [\"c:1\"], "
     "kv_cache_config: {enable_block_reuse: 1}}\n",
     ["context_servers.kv_cache_config.enable_block_reuse", "true or false"]),
    ("model: {engine: engines/demo}\ncontext_servers: {urls: \"c:1\"}\n",
     ["context_servers.urls", "list"]),
    ("model: {engine: engines/demo}\nport: \"8000\"\n", ["port", "OpenAI front"]),
])
def test_trtllm_mistakes_are_one_line(write, text, words):
    assert_one_line_error(write(text), words)


def test_the_config_docs_trtllm_example_loads(write, capsys):
    doc = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", doc, re.S) if "context_servers" in b]
    config = load_config(write(block))
    assert config.generation.router == "least_loaded" and config.context.url == "127.0.0.1:9001"
    (line,) = capsys.readouterr().err.splitlines()
    assert "backend" in line and "ignored" in line

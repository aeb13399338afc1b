"""The guide's commands' config side: ``serve context|generation --gpus 0,1`` replaces the
role's placement (GPUs this host lacks: one line naming the flag), and TensorRT-LLM's
disaggregated config loads, mapped onto ours, with one line per key we do not support."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from config_files import assert_one_line_error, config_writer
from triton_disagg.config.disagg import load_config
from triton_disagg.config.host import with_gpus_flag
from triton_disagg.errors import UserError

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
    assert config.scheduler.url == "localhost:8001" and config.scheduler.http_port == 8000
    lines = capsys.readouterr().err.splitlines()
    assert all(line.split(": ")[0].endswith("disagg_config.yaml") for line in lines), lines
    said = {line.split(": ", 2)[1] for line in lines}
    assert said == {"backend", "otlp_config", "context_servers.max_batch_size",
                    "context_servers.kv_cache_config.free_gpu_memory_fraction",
                    "context_servers.cache_transceiver_config"}, lines
    assert any(line.endswith("one value for every role: kv_cache.gpu_memory_fraction")
               for line in lines), lines


def test_trtllm_disagg_cluster_becomes_discovery(write):
    config = load_config(write("model: {engine: engines/demo}\n"
                               "disagg_cluster: {cluster_uri: \"etcd://etcd-0:2379\", "
                               "cluster_name: prod}\n"
                               "context_servers: {num_instances: 1}\n"
                               "generation_servers: {num_instances: 1}\n"))
    assert config.discovery.etcd == "etcd-0:2379"
    assert config.discovery.prefix == "/triton-disagg/prod"


@pytest.mark.parametrize("text, words", [
    ("hostname: localhost\ncontext_servers: {urls: [\"c:1\"]}\n", ["model", "engine"]),
    ("model: {engine: engines/demo}\ncontext_servers: {num_instances: 2, urls: [\"c:1\"]}\n",
     ["context_servers.num_instances", "one url per instance"]),
    ("model: {engine: engines/demo}\ngeneration_servers: {urls: [\"g:1\"], "
     "tensor_parallel_size: 2}\n", ["generation_servers.tensor_parallel_size", "2"]),
    ("model: {engine: engines/demo}\ndisagg_cluster: {cluster_uri: \"http://h:1\"}\n",
     ["disagg_cluster.cluster_uri", "etcd://"]),
    ("model: {engine: engines/demo}\ncontext_servers: {urls: \"c:1\"}\n",
     ["context_servers.urls", "list"]),
])
def test_trtllm_mistakes_are_one_line(write, text, words):
    assert_one_line_error(write(text), words)


def test_the_readmes_trtllm_example_loads(write, capsys):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if "context_servers" in b]
    config = load_config(write(block))
    assert config.generation.router == "least_loaded" and config.context.url == "127.0.0.1:9001"
    (line,) = capsys.readouterr().err.splitlines()
    assert "backend" in line and "ignored" in line

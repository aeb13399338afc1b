"""disagg_config.yaml: the deployment guide's format loads as written; mistakes are one line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from triton_disagg.config.disagg import default_config, load_config
from triton_disagg.config.host import check_host, front_cpus
from triton_disagg.config.values import parse_size
from config_files import assert_one_line_error, config_writer
from triton_disagg.errors import UserError

GUIDE = """\
model: {engine: engines/demo}
context_server:    {url: "context-server-01:8000",    gpus: [0, 1]}
generation_server: {url: "generation-server-01:8001", gpus: [2, 3]}
kv_cache: {strategy: direct_transfer, max_size: 2GB}
"""


@pytest.fixture
def write(tmp_path):
    return config_writer(tmp_path)


def test_guide_format_loads_as_written(write, tmp_path):
    cfg = load_config(write(GUIDE))
    assert cfg.engine == (tmp_path / "engines" / "demo").resolve()
    assert cfg.context.url == "context-server-01:8000" and cfg.context.gpus == (0, 1)
    assert cfg.context.instances == 2 and cfg.generation.port == 8001
    assert cfg.kv_cache.strategy == "direct_transfer" and cfg.kv_cache.max_size == 2 * 10**9
    assert cfg.mode == "disaggregated"


def test_cpu_host_extensions(write):
    cfg = load_config(write(
        "model: {engine: engines/demo}\nmode: aggregated\n"
        "context_server: {url: 'localhost:9001', cpus: [0, 1], instances: 2, tokens_per_block: 8}\n"
        "generation_server: {url: 'localhost:9002', cpus: [1], kv_dtype: float16, "
        "stream_interval: 4, stall_seconds: 2.5}\n"
        "kv_cache: {strategy: host_memory, max_size: 64MiB, lease_seconds: 5}\n"))
    assert cfg.mode == "aggregated"
    assert cfg.context.instance_cpus(0) == (0,) and cfg.context.instance_cpus(1) == (1,)
    assert cfg.generation.instance_cpus(0) == (1,) and cfg.generation.kv_dtype == "float16"
    assert cfg.generation.stream_interval == 4 and cfg.context.stream_interval == 1
    assert cfg.generation.stall_seconds == 2.5 and cfg.context.stall_seconds == 30.0
    assert cfg.kv_cache.max_size == 64 * 2**20 and cfg.kv_cache.lease_seconds == 5.0


@pytest.mark.parametrize("generation, instances", [
    ("{cpus: [2, 3]}", 2), ("{cpus: [1, 2, 3]}", 2), ("{cpus: [1]}", 1), ("{}", 1),
    ("{cpus: [2, 3], instances: 1}", 1)])
def test_generation_runs_two_instances_where_its_cores_allow(write, generation, instances):
    cfg = load_config(write("model: {engine: engines/demo}\ncontext_server: {cpus: [0, 1]}\n"
                            f"generation_server: {generation}\n"))
    assert cfg.generation.instances == instances and cfg.context.instances == 1


@pytest.mark.parametrize("text, words", [
    ("model: {engine: engines/demo}\nkv_cache: {max_size: 2XB}\n", ["kv_cache.max_size", "2GB"]),
    ("model: {engine: engines/demo}\ncontext_server: {url: a:1, gpu: [0]}\n",
     ["context_server", "'gpu'", "allowed keys"]),
    ("model: {engine: engines/missing}\n", ["model.engine", "triton-disagg build"]),
    ("context_server: {url: 'a:1'}\n", ["model.engine: missing", "--engine"]),
    ("model: {engine: engines/demo}\nkv_cache: {strategy: rdma}\n", ["kv_cache.strategy"]),
    ("model: {engine: engines/demo}\nmode: split\n", ["mode", "aggregated"]),
    ("model: {engine: engines/demo}\ngeneration_server: {url: nohostport}\n",
     ["generation_server.url", "host:port"]),
    ("model: {engine: engines/demo}\ncontext_server: {cpus: [0], instances: 2}\n",
     ["context_server.cpus", "one core per instance"]),
    ("model: {engine: engines/demo}\ncontext_server: {tokens_per_block: 12}\n",
     ["context_server.tokens_per_block", "power of two"]),
    ("model: {engine: engines/demo}\ncontext_server: {gpus: [0], cpus: [1]}\n", ["either gpus"]),
    ("model: {engine: engines/demo}\ngeneration_server: {stream_interval: 0}\n",
     ["generation_server.stream_interval", ">= 1"]),
    ("model: {engine: engines/demo}\ncontext_server: {stream_interval: 2}\n",
     ["context_server", "'stream_interval'", "allowed keys"]),
    ("model: {engine: engines/demo}\ngeneration_server: {stall_seconds: 0}\n",
     ["generation_server.stall_seconds", "> 0"]),
    ("model: {engine: engines/demo}\ngeneration_server: {stall_seconds: forever}\n",
     ["generation_server.stall_seconds", "number of seconds"]),
    ("model: {engine: engines/demo}\ncontext_server: {stall_seconds: 5}\n",
     ["context_server", "'stall_seconds'", "allowed keys"]),
    ("model: {engine: [}\n", ["not valid YAML"]),
    ("model: {engine: engines/demo, runtime: jax}\n", ["model.runtime", "numpy, torch"]),
    ("model: {engine: engines/demo, device: tpu}\n", ["model.device", "cpu, cuda"]),
    ("model: {engine: engines/demo, runtime: numpy, device: cuda}\n",
     ["model.device", "needs model.runtime: torch"]),
    ("model: {engine: engines/demo, device: cpu, dtype: bfloat16}\n",
     ["model.dtype", "float32 on CPU"]),
    ("model: {engine: engines/demo, tensor_parallel_size: 2}\n",
     ["model.tensor_parallel_size", "only 1 is supported"]),
    ("model: {engine: engines/demo}\nkv_cache: {lease_seconds: .nan}\n",
     ["kv_cache.lease_seconds", "nan", "finite"]),
    ("model: {engine: engines/demo}\nkv_cache: {lease_seconds: .inf}\n",
     ["kv_cache.lease_seconds", "inf", "finite"]),
    ("model: {engine: engines/demo}\nkv_cache: {overlap_transfer: true, strategy: host_memory}\n",
     ["kv_cache.overlap_transfer", "needs kv_cache.strategy direct_transfer", "host_memory"]),
    ("model: {engine: engines/demo}\nmode: aggregated\nkv_cache: {overlap_transfer: true}\n",
     ["kv_cache.overlap_transfer", "aggregated", "nothing to overlap"]),
    ("model: {engine: engines/demo}\nkv_cache: {overlap_transfer: true}\n"
     "context_server: {tokens_per_block: 8}\n",
     ["kv_cache.overlap_transfer", "context_server.tokens_per_block is 8", "give both the same"]),
    ("model: {engine: engines/demo}\nkv_cache: {overlap_transfer: sometimes}\n",
     ["kv_cache.overlap_transfer", "true or false"]),
    ("model: {engine: engines/demo}\nkv_cache: {prefix_caching: \"no\"}\n",
     ["kv_cache.prefix_caching", "true or false"]),
    ("model: {engine: engines/demo}\nkv_cache: {gpu_memory_fraction: 0}\n",
     ["kv_cache.gpu_memory_fraction", "> 0 and <= 1"]),
    ("model: {engine: engines/demo}\nkv_cache: {gpu_memory_fraction: 90%}\n",
     ["kv_cache.gpu_memory_fraction", "e.g. 0.9"]),
])
def test_mistakes_are_one_line_naming_the_key(write, text, words):
    assert_one_line_error(write(text), words)


def test_gpus_where_none_exist(write):
    cfg = load_config(write(GUIDE))
    with pytest.raises(UserError, match=r"context_server.gpus.*no GPUs.*cpus: \[0\]"):
        check_host(cfg, gpu_count=0)
    check_host(cfg, gpu_count=4)


def test_model_runtime_carried_to_the_engine_settings(write, tmp_path):
    from triton_disagg.config.settings import from_json, to_json
    from triton_disagg.triton.render import settings

    cfg = load_config(write("model: {engine: engines/demo, runtime: torch, device: cpu, "
                            "tensor_parallel_size: 1}\n"))
    assert (cfg.runtime, cfg.device, cfg.dtype) == ("torch", "cpu", None)
    for model in ("context", "generation"):
        carried = from_json(model, to_json(settings(model, "all", cfg)))
        assert (carried.runtime, carried.device, carried.dtype) == ("torch", "cpu", None)


def test_gpu_memory_fraction_carried_to_the_engine_settings(write):
    from triton_disagg.config.settings import from_json, to_json
    from triton_disagg.triton.render import settings

    assert load_config(write(GUIDE)).kv_cache.gpu_memory_fraction == 0.9
    cfg = load_config(write(GUIDE.replace("max_size: 2GB", "max_size: 2GB, "
                                          "gpu_memory_fraction: 0.5")))
    for model in ("context", "generation"):
        carried = from_json(model, to_json(settings(model, "disaggregated", cfg)))
        assert carried.kv_gpu_memory_fraction == 0.5


def test_prefix_caching_on_by_default_and_carried_to_the_engine(write, tiny_engines):
    from triton_disagg.config.settings import from_json, to_json
    from triton_disagg.engine.capacity import make_engine
    from triton_disagg.triton.render import settings

    assert load_config(write(GUIDE)).kv_cache.prefix_caching is True
    cfg = load_config(write(GUIDE.replace("max_size: 2GB", "max_size: 2GB, prefix_caching: false")))
    for model in ("context", "generation"):
        carried = from_json(model, to_json(settings(model, "disaggregated", cfg)))
        assert carried.kv_prefix_caching is False
        engine = make_engine(replace(carried, engine=str(tiny_engines["llama"]),
                                     kv_max_size=2**24), model)
        assert engine.pool.cache is None


def test_kv_events_host_reaches_the_engine_settings_and_the_kv_dtype_the_pools(write):
    from triton_disagg.config.settings import from_json, to_json
    from triton_disagg.triton.render import settings

    cfg = load_config(write(GUIDE.replace("gpus: [0, 1]}", "gpus: [0, 1], kv_dtype: float32, "
                                                         "router: kv_aware}")))
    for model in ("context", "generation"):
        carried = from_json(model, to_json(settings(model, model, cfg, None, "0.0.0.0",
                                                    "ctx-01.example")))
        assert (carried.kv_events_host, carried.kv_events_bind) == ("ctx-01.example", "0.0.0.0")
        unset = from_json(model, to_json(settings(model, "all", cfg)))
        assert (unset.kv_events_host, unset.kv_events_bind) == (None, None)     # ipc
    pools = from_json("orchestrator", to_json(settings("orchestrator", "scheduler", cfg))).pools
    assert (pools["context"].router, pools["context"].kv_dtype) == ("kv_aware", "float32")
    carried = from_json("context", to_json(settings("context", "context", cfg, None,
                                                    "0.0.0.0", "ctx-01", 6002)))
    assert carried.kv_events_port == 6002


def test_servers_sharing_a_config_publish_kv_events_on_ports_of_their_own(write):
    from triton_disagg.launch.serve_cli import _kv_events_at
    from triton_disagg.routing.kv_events import publisher_ports
    from triton_disagg.triton.render import settings

    cfg = load_config(write("model: {engine: engines/demo}\n"
                            "context_server: {urls: ['h:2', 'h:1'], instances: 2, "
                            "kv_events_port: 6000}\n"))
    assert _kv_events_at("context", cfg, "h:2") == ("h", range(6000, 6002))   # first listed
    assert _kv_events_at("context", cfg, "h:1") == ("h", range(6002, 6004))   # after h:2's
    assert _kv_events_at("context", cfg, "other:9") == ("other", range(6000, 6002))  # unlisted
    assert _kv_events_at("scheduler", cfg, "h:2") == (None, ())
    assert list(publisher_ports(6000, ["h:2", "h:1"], "h:1", 2)) == [6002, 6003]
    pool = settings("orchestrator", "scheduler", cfg).pools["context"]
    assert (pool.urls, pool.kv_events_port, pool.instances) == (("h:2", "h:1"), 6000, 2)


def test_cuda_where_no_gpu_exists(write):
    cfg = load_config(write("model: {engine: engines/demo, runtime: torch, device: cuda}\n"))
    with pytest.raises(UserError, match=r"model.device: cuda.*no NVIDIA GPU.*device: cpu"):
        check_host(cfg, gpu_count=0)
    check_host(cfg, gpu_count=1)


def test_defaults_from_engine_only(tmp_path):
    (tmp_path / "engine.json").write_text("{}")
    cfg = default_config(tmp_path)
    assert cfg.context.instances == 1 and cfg.context.instance_cpus(0) == ()
    with pytest.raises(UserError, match="--engine"):
        default_config(tmp_path / "nope")


@pytest.mark.parametrize("value, size", [("2GB", 2 * 10**9), ("512MiB", 512 * 2**20),
                                         (1000, 1000), ("1.5 KB", 1500)])
def test_sizes(value, size):
    assert parse_size(value, "k") == size


@pytest.mark.parametrize("context, generation, refused", [
    ("10.0.0.1", "10.0.0.2", True), ("ctx-01", "gen-01", True),
    ("ctx-01", "CTX-01", False), ("localhost", "10.0.0.2", False), ("127.0.0.1", "::1", False)])
def test_host_memory_needs_one_host(write, context, generation, refused):
    text = ("model: {engine: engines/demo}\nkv_cache: {strategy: host_memory}\n"
            f"context_server: {{url: '{context}:9001'}}\n"
            f"generation_server: {{url: '{generation}:9002'}}\n")
    if refused:
        with pytest.raises(UserError) as err:
            load_config(write(text))
        assert "\n" not in str(err.value)
        assert "host_memory needs context and generation on one host" in str(err.value)
        load_config(write(text.replace("host_memory", "direct_transfer")))
        text += "mode: aggregated\n"                  # no handoff: nothing is staged
    load_config(write(text))


def test_scheduler_instances_share_the_front_ends_cores(write):
    cfg = load_config(write("model: {engine: engines/demo}\n"
                            "scheduler_server: {cpus: [0], instances: 2}\n"))
    assert cfg.scheduler.cpus == (0,) and cfg.scheduler.instances == 2


def test_unusable_cores_are_refused_for_every_placed_role(write):
    import os

    unusable = max(os.sched_getaffinity(0)) + 1
    for role in ("context", "generation", "scheduler"):
        cfg = load_config(write(f"model: {{engine: engines/demo}}\n"
                                f"{role}_server: {{cpus: [{unusable}]}}\n"))
        with pytest.raises(UserError) as err:
            check_host(cfg, gpu_count=0)
        message = str(err.value)
        assert "\n" not in message and "disagg_config.yaml" in message
        assert f"{role}_server.cpus: core {unusable} is not usable here" in message
        assert "pick cores from that list" in message
    check_host(cfg, gpu_count=0, roles=("context", "generation"))   # serve context: not its


@pytest.mark.parametrize("scheduler, generation, role, usable, front", [
    ("{}", "{cpus: [1]}", "all", {0, 1}, (0,)),              # beside the decode cores
    ("{}", "{cpus: [2, 3]}", "all", {0, 1, 2, 3}, (0, 1)),
    ("{}", "{cpus: [0, 1]}", "all", {0, 1}, ()),              # nothing left: not pinned
    ("{}", "{}", "all", {0, 1}, ()),                          # generation not pinned either
    ("{cpus: [1]}", "{cpus: [1]}", "all", {0, 1}, (1,)),      # given: as given
    ("{cpus: [2]}", "{cpus: [1]}", "scheduler", {0, 1, 2}, (2,)),
    ("{}", "{cpus: [1]}", "scheduler", {0, 1}, ()),           # generation is another host's
    ("{cpus: [0]}", "{cpus: [1]}", "generation", {0, 1}, ()),  # no front end there
    ("{cpus: [0]}", "{cpus: [1]}", "context", {0, 1}, ()),
])
def test_front_end_cores(write, scheduler, generation, role, usable, front):
    cfg = load_config(write(f"model: {{engine: engines/demo}}\nscheduler_server: {scheduler}\n"
                            f"generation_server: {generation}\n"))
    assert front_cpus(cfg, role, usable) == front


def test_overlap_transfer_reaches_the_orchestrator_and_the_serve_flag_sets_it(write, tmp_path,
                                                                             capsys):
    from triton_disagg.config.disagg import with_overlap
    from triton_disagg.triton.render import settings

    assert not load_config(write("model: {engine: engines/demo}\n")).kv_cache.overlap_transfer
    on = load_config(write("model: {engine: engines/demo}\nkv_cache: {overlap_transfer: true}\n"))
    assert on.kv_cache.overlap_transfer
    assert settings("orchestrator", "all", on).overlap_kv_transfer
    off = load_config(write("model: {engine: engines/demo}\n"))
    assert not settings("orchestrator", "all", off).overlap_kv_transfer
    assert with_overlap(off).kv_cache.overlap_transfer
    staged = load_config(write("model: {engine: engines/demo}\nkv_cache: {strategy: host_memory}\n"))
    with pytest.raises(UserError, match="--overlap_kv_transfer: .*direct_transfer"):
        with_overlap(staged)


@pytest.mark.parametrize("gpu, given, chosen", [
    (False, {}, ("numpy", "cpu", "float32")),
    (False, {"runtime": "torch"}, ("torch", "cpu", "float32")),
    (True, {}, ("torch", "cuda", "bfloat16")),
    (True, {"runtime": "numpy"}, ("numpy", "cpu", "float32")),
    (True, {"device": "cpu"}, ("numpy", "cpu", "float32")),
    (True, {"dtype": "float16"}, ("torch", "cuda", "float16")),
])
def test_runtime_defaults_follow_the_host(monkeypatch, gpu, given, chosen):
    from triton_disagg.engine import runtime

    monkeypatch.setattr(runtime, "_cuda_visible", lambda: gpu)
    got = runtime.Runtime.default(**given)
    assert (got.runtime, got.device, got.dtype) == chosen

"""Device memory and placement of the torch runtime, checked on CPU: which CUDA device a
Triton GPU instance uses, how much of it the KV pool takes, the one line when the engine
does not fit, and a KV connector never handed host memory that stands in for device KV.

The only fake is at the GPU boundary: a runner whose device allocation fails the way
torch's CUDA allocator does (``torch.OutOfMemoryError``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from triton_disagg.engine.block_pool import BlockPool
from triton_disagg.engine.runtime import Runtime, kv_budget, make_runner
from triton_disagg.errors import UserError
from triton_disagg.kv.layout import BlockGeometry
from triton_disagg.triton.placement import gpu_index

GIB = 2**30


def test_a_gpu_instance_runs_on_the_device_triton_gave_it():
    args = {"model_instance_kind": "GPU", "model_instance_device_id": "2"}
    assert gpu_index(args) == 2
    assert gpu_index({"model_instance_kind": "CPU", "model_instance_device_id": "0"}) is None
    assert Runtime.default("torch", "cuda", None, gpu_index(args)).torch_device == "cuda:2"
    assert Runtime.default("torch", "cuda").torch_device == "cuda:0"
    # a CPU runtime ignores the instance's GPU: the device id names no CPU
    assert Runtime.default("numpy", "cpu", None, 2) == Runtime("numpy", "cpu", "float32", 0)
    with pytest.raises(UserError, match="only CUDA devices are numbered"):
        Runtime("torch", "cpu", "float32", 1)


@pytest.mark.parametrize("free, cap, weights, fraction, budget", [
    (80 * GIB, None, 16 * GIB, 0.9, int(64 * GIB * 0.9)),    # fraction of what the weights leave
    (80 * GIB, 2 * GIB, 16 * GIB, 0.9, 2 * GIB),              # kv_cache.max_size caps it
    (80 * GIB, None, 16 * GIB, 0.5, 32 * GIB),
    (10 * GIB, None, 16 * GIB, 0.9, 0),                       # weights alone do not fit
])
def test_kv_pool_budget_is_a_fraction_of_free_device_memory(free, cap, weights, fraction,
                                                           budget):
    assert kv_budget(free, cap, weights, fraction) == budget


class FakeCudaOutOfMemoryRunner:
    """The GPU boundary: a runner whose device allocation fails as CUDA's allocator does."""

    def __init__(self, *args, **kwargs):
        import torch

        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_out_of_device_memory_at_load_is_one_line_naming_the_settings(monkeypatch):
    pytest.importorskip("torch")
    import triton_disagg.engine.torch_model as torch_model

    monkeypatch.setattr(torch_model, "TorchModelRunner", FakeCudaOutOfMemoryRunner)
    pool = BlockPool(BlockGeometry(2, 4, 8, 16, "float32"), 64)
    weights = {"embed": np.zeros((1024, 256), np.float32)}
    with pytest.raises(UserError) as err:
        make_runner(Runtime("torch", "cpu"), SimpleNamespace(), weights, pool)
    line = str(err.value)
    assert "\n" not in line and "out of memory on cpu" in line
    assert "kv_cache.gpu_memory_fraction" in line and "kv_cache.max_size" in line
    kv_mib = 64 * pool.geometry.block_nbytes >> 20
    assert "1 MiB of float32 weights" in line and f"a {kv_mib} MiB KV pool" in line


def test_a_connector_stages_kv_that_lives_on_the_device(monkeypatch):
    """On CUDA the runner computes KV in device memory, not in ``pool.array``: the connector
    registers a staging buffer through which the runner copies handed-off blocks (on CPU:
    nothing to stage, the runner computes in ``pool.array`` itself)."""
    from triton_disagg.kv.connector_factory import connector_for
    from triton_disagg.kv.secret import SECRET_ENV, render_key_id

    monkeypatch.setenv(SECRET_ENV, "s" * 64)
    pool = BlockPool(BlockGeometry(2, 4, 8, 16, "float32"), 4)
    settings = SimpleNamespace(kv_strategy="host_memory", kv_key_id=render_key_id(),
                               kv_lease_seconds=30.0, kv_max_size=2 * 10**9)
    for runtime, staged in ((Runtime("torch", "cuda", "bfloat16", 1), True),
                            (Runtime("torch", "cpu"), False)):
        engine = SimpleNamespace(pool=pool, spec=SimpleNamespace(fingerprint="f" * 64,
                                                                 max_context=8),
                                 runtime=runtime, runner=object())
        connector = connector_for(settings, engine, "conntest_0_0", lambda blocks: None)
        try:
            assert (connector.pool.array is pool.array) != staged
            assert staged or connector.pool.staging is None
            assert not staged or connector.pool.staging.device_kv is engine.runner
        finally:
            connector.close()


def test_a_cuda_pool_is_counted_in_device_bytes_and_too_small_is_one_line():
    """bfloat16 KV of a float32 layout takes half the bytes on the device, so a budget holds
    twice the blocks; a budget short of one longest sequence names the settings."""
    from triton_disagg.engine.runtime import device_pool_blocks

    geometry = BlockGeometry(2, 4, 8, 16, "float32")
    cuda = Runtime("torch", "cuda", "bfloat16", 1)
    assert cuda.kv_block_bytes(geometry) * 2 == geometry.block_nbytes
    assert Runtime("torch", "cpu").kv_block_bytes(geometry) == geometry.block_nbytes
    budget = 100 * geometry.block_nbytes
    assert device_pool_blocks(cuda, geometry, budget, 0.9, blocks_needed=128) == 200
    with pytest.raises(UserError) as err:
        device_pool_blocks(cuda, geometry, budget, 0.9, blocks_needed=201)
    line = str(err.value)
    assert "\n" not in line and line.startswith("out of memory on cuda:1")
    assert "200 KV blocks" in line and "needs 201" in line
    assert "raise kv_cache.gpu_memory_fraction or kv_cache.max_size" in line


@pytest.mark.parametrize("written, device, cap", [
    ({}, "cuda", None),                               # gpu_memory_fraction alone sizes it
    ({"max_size": "8GB"}, "cuda", 8 * 10**9),         # a written max_size caps it
    ({}, "cpu", 2 * 10**9),                           # on CPU the default sizes the pool
])
def test_gpu_memory_fraction_sizes_a_cuda_pool_unless_max_size_is_written(
        demo_engine, monkeypatch, written, device, cap):
    """The 2 GB default of ``kv_cache.max_size`` no longer caps a GPU pool (it made
    ``gpu_memory_fraction`` do nothing on an 80-140 GB GPU); a written one still does."""
    import triton_disagg.engine.llm_engine as llm_engine
    from triton_disagg.config.disagg import parse_config
    from triton_disagg.config.settings import from_json, to_json
    from triton_disagg.engine.capacity import check_kv_capacity, make_engine
    from triton_disagg.triton.render import settings as model_settings

    config = parse_config({"model": {"engine": str(demo_engine), "runtime": "torch",
                                     "device": device},
                           "kv_cache": {**written, "gpu_memory_fraction": 0.8}})
    assert config.kv_cache.max_size_given == bool(written)
    check_kv_capacity(config)
    settings = model_settings("generation", "generation", config)
    assert from_json("generation", to_json(settings)) == settings     # travels to the model
    made = {}
    monkeypatch.setattr(llm_engine, "LLMEngine",
                        lambda engine, **kw: made.update(kw) or SimpleNamespace(**kw))
    make_engine(settings, "generation", device_index=0)
    assert made["kv_max_bytes"] == cap and made["kv_memory_fraction"] == 0.8


def test_a_dropped_engine_frees_its_pool_without_waiting_for_the_garbage_collector(demo_engine):
    """Nothing in an engine refers back to it (the scheduler's first-token hook is a plain
    function): on CUDA a ``del engine`` then frees the device KV pool and weights at once,
    not when (if ever) a collection runs. Checked with the collector off."""
    import gc
    import weakref

    from triton_disagg.engine.llm_engine import LLMEngine
    from triton_disagg.engine.sampling import SamplingParams

    def engine():
        made = LLMEngine(demo_engine, num_blocks=16, runtime=Runtime("torch", "cpu"))
        made.generate([[3, 4, 5]], SamplingParams(max_tokens=3))
        return made

    engine()                 # first use imports lazily; torch may keep that frame around
    gc.disable()
    try:
        made = engine()
        pool, kv = weakref.ref(made.pool), weakref.ref(made.runner.kv)
        del made
        assert pool() is None and kv() is None
    finally:
        gc.enable()

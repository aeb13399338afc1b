"""KV the torch runner computes in device memory is handed off through a bounded staging
buffer, not a host copy of the whole pool: the exported blocks are copied device -> staging
rows (in the pool's dtype), a connector moves the rows, and they are copied rows -> device
blocks, so a sequence handed off between two runners decodes as it would have on the first.

No GPU here: "device memory" is faked by giving each runner its own KV tensor on the CPU
(``kv.clone()``), which is all that differs on CUDA besides the device the copies cross;
the engine's CUDA runner and budget are faked at the GPU boundary."""

from types import SimpleNamespace

import numpy as np
import pytest

from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import Runtime
from triton_disagg.kv.device_staging import DeviceStaging

PROMPT = [3, 17, 29, 4, 8, 51, 12, 7, 33, 2]


@pytest.fixture(scope="module")
def engine_dir(tiny_checkpoints, tmp_path_factory):
    from triton_disagg.builders.build import build_engine

    out = tmp_path_factory.mktemp("staging") / "llama"
    build_engine(tiny_checkpoints["llama"], out, tokens_per_block=4, max_batch_size=4)
    return out


def runner_with_fake_device_kv(engine_dir):
    engine = LLMEngine(engine_dir, runtime=Runtime("torch", "cpu", "float32"))
    runner = engine.runner
    runner.kv = runner.kv.clone()          # fake device memory: no longer pool.array's
    return runner


def test_a_handoff_through_staging_rows_decodes_as_without_one(engine_dir):
    context, generation = runner_with_fake_device_kv(engine_dir), runner_with_fake_device_kv(engine_dir)
    geometry = context.pool.geometry
    out, into = DeviceStaging(context, geometry, 3), DeviceStaging(generation, geometry, 3)
    src_blocks, dst_blocks = [5, 1, 7], [2, 6, 0]          # 10 tokens: 3 blocks of 4
    logits = context.prefill([(PROMPT, src_blocks)])
    rows = out.reserve(src_blocks)
    out.to_host(src_blocks)
    assert out.array.dtype == context.pool.array.dtype and len(out.array) == 3
    assert out.array[rows].tobytes() == context.kv[src_blocks].numpy().tobytes()
    dst_rows = into.reserve(dst_blocks)
    into.array[dst_rows] = out.array[rows]                  # what a KV connector moves
    into.to_device(dst_rows)
    assert generation.kv[dst_blocks].numpy().tobytes() == out.array[rows].tobytes()
    assert not generation.kv[[1, 3]].numpy().any()          # nothing else written
    assert out.release(rows) == src_blocks and into.release(dst_rows) == dst_blocks
    assert out.num_free == into.num_free == 3
    token = int(np.argmax(logits[0]))
    there = generation.decode([token], [len(PROMPT)], [dst_blocks])
    here = context.decode([token], [len(PROMPT)], [src_blocks])
    np.testing.assert_array_equal(there, here)


def test_a_cuda_engine_keeps_no_host_copy_of_its_pool(engine_dir, monkeypatch):
    """A CUDA engine's block pool has no host array; its connector registers a staging
    buffer of kv_cache.max_size bytes in the pool's layout dtype (here float16: half a
    float32 mirror's bytes per block), not a float32 mirror of every block."""
    import triton_disagg.engine.llm_engine as llm_engine
    import triton_disagg.engine.runtime as runtime
    from triton_disagg.engine.spec import KVLayout
    from triton_disagg.kv.connector_factory import connector_for
    from triton_disagg.kv.secret import SECRET_ENV, render_key_id

    monkeypatch.setattr(runtime, "device_kv_budget", lambda *a: 1 << 30)      # 1 GiB free
    monkeypatch.setattr(llm_engine, "make_runner",                            # GPU boundary
                        lambda runtime, spec, weights, pool: SimpleNamespace(
                            max_context=spec.max_context))
    engine = LLMEngine(engine_dir, runtime=Runtime("torch", "cuda", "bfloat16"),
                       kv_layout=KVLayout(4, "float16"))
    assert engine.pool.array is None
    geometry = engine.pool.geometry
    monkeypatch.setenv(SECRET_ENV, "s" * 64)
    settings = SimpleNamespace(kv_strategy="host_memory", kv_key_id=render_key_id(),
                               kv_lease_seconds=30.0, kv_max_size=256 * geometry.block_nbytes)
    connector = connector_for(settings, engine, "conntest_0_0", lambda blocks: None)
    try:
        array = connector.pool.array
        assert array.shape == (256, *geometry.block_shape) and array.dtype == np.float16
        assert engine.pool.num_total > 1000 * len(array)      # the pool is far larger
        assert connector.pool.staging.device_kv is engine.runner
    finally:
        connector.close()

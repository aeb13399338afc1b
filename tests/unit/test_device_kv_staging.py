"""The torch runner's host mirror: KV it computes apart from ``pool.array`` (device memory on
CUDA) is copied block for block to the host array before an export and back after a fetch,
so a sequence handed off between two runners decodes as it would have on the first.

No GPU here: "device memory" is faked by giving each runner its own KV tensor on the CPU
(``kv.clone()``), which is all that differs on CUDA besides the device the copies cross.
"""

import numpy as np
import pytest

from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import Runtime

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


def test_a_handoff_through_the_host_mirrors_decodes_as_without_one(engine_dir):
    context, generation = runner_with_fake_device_kv(engine_dir), runner_with_fake_device_kv(engine_dir)
    src_blocks, dst_blocks = [5, 1, 7], [2, 6, 0]          # 10 tokens: 3 blocks of 4
    logits = context.prefill([(PROMPT, src_blocks)])
    assert not context.pool.array.any()                    # computed on the "device" only
    context.blocks_to_host(src_blocks)
    host = context.pool.array
    assert host[src_blocks].tobytes() == context.kv[src_blocks].numpy().tobytes()
    generation.pool.array[dst_blocks] = host[src_blocks]    # what a KV connector moves
    generation.blocks_to_device(dst_blocks)
    assert generation.kv[dst_blocks].numpy().tobytes() == host[src_blocks].tobytes()
    assert not generation.kv[[1, 3]].numpy().any()          # nothing else written
    token = int(np.argmax(logits[0]))
    there = generation.decode([token], [len(PROMPT)], [dst_blocks])
    here = context.decode([token], [len(PROMPT)], [src_blocks])
    np.testing.assert_array_equal(there, here)

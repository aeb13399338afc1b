"""The prefill's per-layer hook, the point where ``--overlap_kv_transfer`` would start moving
a layer group's KV while later layers compute: called once per layer, in order, each time
with that layer's KV of every prompt final and the later layers' not yet written."""

import numpy as np
import pytest

from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import Runtime
from triton_disagg.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine_dir(tiny_checkpoints, tmp_path_factory):
    from triton_disagg.builders.build import build_engine

    out = tmp_path_factory.mktemp("hook") / "llama"
    build_engine(tiny_checkpoints["llama"], out, tokens_per_block=4, max_batch_size=4)
    return out


@pytest.mark.parametrize("runtime", ["numpy", "torch"])
def test_each_layer_is_final_when_its_hook_runs_and_later_ones_are_not_written(
        engine_dir, runtime):
    engine = LLMEngine(engine_dir, runtime=Runtime(runtime, "cpu", "float32"))
    pool = engine.pool.array                        # [N, L, 2, bs, kvh, hd], all zero
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, engine.spec.shape.vocab_size, n).tolist() for n in (9, 14)]
    seen: list[tuple[int, np.ndarray, bool]] = []

    def on_layer(li: int) -> None:
        used = np.flatnonzero(engine.pool.array.any(axis=(1, 2, 3, 4, 5)))   # blocks written
        seen.append((li, pool[used, li].copy(), not pool[used, li + 1:].any()))

    results = engine.prefill_only([(str(i), p, SamplingParams(max_tokens=4))
                                   for i, p in enumerate(prompts)], on_layer)
    blocks = sorted(b for r in results for b in r.block_ids)
    assert [li for li, _, _ in seen] == list(range(engine.spec.shape.num_layers))
    for li, snapshot, later_unwritten in seen:
        assert later_unwritten
        np.testing.assert_array_equal(snapshot, pool[blocks, li])
    with_hook = [r.token_id for r in results]
    for r in results:
        engine.pool.free(r.block_ids)
    assert with_hook == [r.token_id for r in engine.prefill_only(
        [(str(i), p, SamplingParams(max_tokens=4)) for i, p in enumerate(prompts)])]

"""Both runners' decode (numpy, torch CPU) attends in length groups: one long prompt joining
short streams must not make every stream read its length, and grouping must not change the
result."""

import numpy as np
import pytest

from triton_disagg.engine import model as numpy_model
from triton_disagg.engine.model import PADDING_LIMIT, length_groups
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import Runtime
from triton_disagg.engine.sampling import SamplingParams


@pytest.mark.parametrize("used", [[10] * 6 + [113], [1], [5, 1, 9, 9, 2, 40, 3, 41],
                                  list(range(1, 30)), [7] * 5])
def test_groups_cover_every_index_once_within_the_padding_limit(used):
    used = np.array(used)
    groups = length_groups(used)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(used)))
    for group in groups:
        assert (np.diff(group) > 0).all()
        assert len(group) * used[group].max() <= PADDING_LIMIT * used[group].sum()


def test_a_long_prompt_among_short_streams_is_attended_alone():
    groups = length_groups(np.array([10] * 6 + [113]))
    assert [g.tolist() for g in groups] == [[0, 1, 2, 3, 4, 5], [6]]


@pytest.fixture(scope="module")
def engine_dir(tiny_checkpoints, tmp_path_factory):
    from triton_disagg.builders.build import build_engine

    out = tmp_path_factory.mktemp("groups") / "llama"
    build_engine(tiny_checkpoints["llama"], out, tokens_per_block=4, max_batch_size=8)
    return out


@pytest.fixture(params=["numpy", "torch"])
def engine(engine_dir, request):
    return LLMEngine(engine_dir, runtime=Runtime(request.param, "cpu", "float32"))


def keys_read(runner, monkeypatch) -> list[int]:
    """Filled as the runner decodes: the keys per sequence (padded span) of each attention
    group it builds (numpy: ``_attention_inputs``' mask; torch: ``_paged_batch``' span)."""
    spans: list[int] = []
    name, span_of = (("_attention_inputs", lambda out: out[1].shape[-1])
                     if hasattr(runner, "_attention_inputs") else
                     ("_paged_batch", lambda out: out.span))
    build = getattr(runner, name)

    def spy(*args, **kwargs):
        out = build(*args, **kwargs)
        spans.append(span_of(out))
        return out

    monkeypatch.setattr(runner, name, spy)
    return spans


def test_grouped_decode_equals_one_padded_batch(engine, monkeypatch):
    rng = np.random.default_rng(0)
    lengths = [3, 5, 2, 90, 4]            # blocks of 4 tokens: one sequence far longer, mid-batch
    prompts = [rng.integers(3, engine.spec.shape.vocab_size, n).tolist() for n in lengths]
    tables, start = [], 0
    for n in lengths:
        k = engine.pool.geometry.blocks_for(n + 1)
        tables.append(list(range(start, start + k)))
        start += k
    engine.runner.prefill([(p, t) for p, t in zip(prompts, tables)])
    tokens, positions = [7] * len(lengths), lengths
    spans = keys_read(engine.runner, monkeypatch)
    grouped = engine.runner.decode(tokens, positions, tables)
    assert sorted(spans) == [8, 92]        # short ones read 2 blocks of 4, the long one 23
    monkeypatch.setattr(numpy_model, "PADDING_LIMIT", 10 ** 9)   # one group, padded to 90
    spans.clear()
    padded = engine.runner.decode(tokens, positions, tables)
    assert spans == [92]
    np.testing.assert_allclose(grouped, padded, rtol=1e-5, atol=1e-5)


def test_long_and_short_prompts_decode_like_one_at_a_time(engine):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, engine.spec.shape.vocab_size, n).tolist() for n in (2, 80, 3)]
    params = SamplingParams(max_tokens=12)
    together = [s.output_ids for s in engine.generate(prompts, params)]
    alone = [engine.generate([p], params)[0].output_ids for p in prompts]
    assert together == alone
    assert engine.pool.num_used == 0

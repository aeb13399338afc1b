"""What the engine refuses, with a message naming what is wrong (empty or out-of-vocabulary
prompts, lengths past the limits, a request id in use, KV of the wrong length, a KV pool of
another model's shape), and that a refusal or an abort leaves no block held."""

import pytest

from hf_reference import engines  # noqa: F401
from triton_disagg.engine.block_pool import BlockPool, KVCacheFullError
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.engine.runtime import Runtime, make_runner
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.errors import RequestError
from triton_disagg.kv.layout import BlockGeometry


def test_invalid_requests_raise_clear_errors_and_abort_frees(engines):
    engine = LLMEngine(engines["gpt2"], num_blocks=8)
    vocab, limit = engine.spec.shape.vocab_size, engine.runner.max_context
    params = SamplingParams(max_tokens=4)
    cases = [([], "empty"), ([1, vocab], "outside the vocabulary"), ([1.5], "integers"),
             ([1] * limit, "shorten it"), ([1] * 40, "lower max_tokens"),
             ([vocab] * limit, "shorten it")]     # the length is checked before the ids
    for prompt, message in cases:
        with pytest.raises(RequestError, match=message):
            engine.add_request("bad", prompt, params)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request("bad", [1], SamplingParams(stop_words=[[vocab]]))
    engine.add_request("a", [1, 2, 3], params)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("a", [1], params)
    engine.step()
    assert engine.pool.num_used > 0 and engine.abort("a") and not engine.abort("a")
    assert engine.pool.num_used == 0 and not engine.has_unfinished()
    held = engine.pool.allocate(6)
    with pytest.raises(KVCacheFullError):
        engine.prefill_only([("p", [1] * 12, params)])
    assert engine.pool.num_used == 6
    engine.pool.free(held)
    with pytest.raises(RequestError, match="raise kv_cache.max_size"):
        engine.prefill_only([("p", [1] * 12, params)] * 3)
    (done,) = engine.prefill_only([("p", [1, 2], SamplingParams(max_tokens=1))])
    assert done.finish_reason == "length" and done.block_ids == [] and engine.pool.num_used == 0
    with pytest.raises(RequestError, match="already finished"):
        engine.add_prefilled("p", [1, 2], 5, SamplingParams(max_tokens=1), TwoTokensOfKV)
    # The prompt has 2 tokens; KV of any other length is refused.
    for prompt in ([1], [1, 2, 3]):
        with pytest.raises(RequestError, match="the KV to fetch holds 2"):
            engine.add_prefilled("p", prompt, 5, params, TwoTokensOfKV)
    assert engine.pool.num_used == 0 and not engine.has_unfinished()


class TwoTokensOfKV:
    """A remote prompt KV of 2 tokens that is never fetched (its request is refused)."""

    num_tokens = 2


@pytest.mark.parametrize("runtime", ["numpy", "torch"])
@pytest.mark.parametrize("other", ["num_layers", "num_kv_heads", "head_dim"])
def test_a_runner_refuses_a_pool_of_another_models_kv(runtime, other, engines):
    """Layers, KV heads and head size must be the model's; tokens per block and dtype may
    differ (the pool's layout)."""
    spec = EngineSpec.load(engines["llama"])
    own = spec.block_geometry()
    fits = BlockGeometry(own.num_layers, own.num_kv_heads, own.head_dim, 8, "float16")
    spec.check_pool(fits)
    wrong = BlockGeometry(**{**own.__dict__, other: getattr(own, other) + 1})
    with pytest.raises(ValueError, match="does not match the model shape"):
        make_runner(Runtime(runtime), spec, {}, BlockPool(wrong, 4))

"""SamplingParams validation and the Sampler's processing steps, one option at a time."""

import random

import numpy as np
import pytest

from triton_disagg.engine.sequence import Sequence
from triton_disagg.engine.sampling import (MAX_LIST_TOKENS, MAX_WORD_TOKENS, MAX_WORDS, Sampler,
                                           SamplingParams, SamplingParamsError, StopWords)
from triton_disagg.errors import UserError
from triton_disagg.engine.block_pool import BlockTable

SAMPLER = Sampler()
LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))


def draw(params, logits=LOGITS, prompt=(), output=(), seed=0):
    return SAMPLER.sample(logits, params, list(prompt), list(output), seed)


def histogram(params, logits=LOGITS, n=3000):
    counts = np.bincount([draw(params, logits, seed=s)[0] for s in range(n)],
                         minlength=len(logits))
    return counts / n


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_greedy_is_argmax_with_its_log_softmax():
    token, logprob, top = draw(SamplingParams(return_log_probs=True))
    assert token == 0 and top is None                # no alternatives unless asked for
    assert logprob == pytest.approx(np.log(0.5), abs=1e-6)
    assert draw(SamplingParams()) == (0, None, None)     # no log-prob unless asked for
    # With a penalty the greedy token comes from the processed logits.
    assert draw(SamplingParams(repetition_penalty=100.0), output=[0])[0] == 1


def test_temperature_sampling_follows_softmax_and_temperature_flattens():
    np.testing.assert_allclose(histogram(SamplingParams(temperature=1.0)),
                               [0.5, 0.3, 0.15, 0.05], atol=0.03)
    hot = histogram(SamplingParams(temperature=5.0))
    expected = np.exp(log_softmax(LOGITS / 5.0))
    np.testing.assert_allclose(hot, expected, atol=0.03)


@pytest.mark.parametrize("options", [
    {"temperature": 2.0, "top_k": 2, "seed": 3},
    {"repetition_penalty": 100.0},                   # greedy on processed logits
    {"bad_words": ((0,),), "presence_penalty": 1.0},
])
def test_logprobs_are_the_raw_models_whatever_the_sampling_options(options):
    """vLLM's default (raw_logprobs): log_softmax of the model's logits, not of the
    processed ones the token was drawn from; the alternatives are the same distribution's."""
    params = SamplingParams(return_log_probs=True, top_logprobs=3, **options)
    token, logprob, top = draw(params, output=[0])
    raw = log_softmax(LOGITS)
    assert token in (0, 1, 2, 3) and logprob == pytest.approx(raw[token], abs=1e-6)
    assert top.ids == [0, 1, 2]                      # most likely first
    np.testing.assert_allclose(top.logprobs, raw[:3], atol=1e-6)


def test_top_k_keeps_the_k_most_likely():
    freq = histogram(SamplingParams(temperature=1.0, top_k=2))
    assert freq[2:].sum() == 0
    np.testing.assert_allclose(freq[:2], [0.5 / 0.8, 0.3 / 0.8], atol=0.03)


@pytest.mark.parametrize("top_p, kept", [(0.5, 1), (0.8, 2), (0.81, 3), (1.0, 4)])
def test_top_p_keeps_the_smallest_nucleus(top_p, kept):
    freq = histogram(SamplingParams(temperature=1.0, top_p=top_p), n=1500)
    assert freq[kept:].sum() == 0
    assert np.all(freq[:kept] > 0)


def test_seeded_draws_are_reproducible_and_depend_on_the_seed_and_position():
    params = SamplingParams(temperature=1.0, seed=7)
    flat = np.zeros(1000, dtype=np.float32)
    a = [draw(params, flat, output=[5] * i, seed=7)[0] for i in range(20)]
    b = [draw(params, flat, output=[5] * i, seed=7)[0] for i in range(20)]
    c = [draw(params, flat, output=[5] * i, seed=8)[0] for i in range(20)]
    assert a == b and a != c and len(set(a)) > 10


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([2.0, 1.5, -1.0, -1.2], dtype=np.float32)
    params = SamplingParams(repetition_penalty=2.0)
    processed = SAMPLER.process(logits, params, [0], [2])
    np.testing.assert_allclose(processed, [1.0, 1.5, -2.0, -1.2])
    assert draw(params, logits, prompt=[0])[0] == 1


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = np.zeros(4, dtype=np.float32)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    processed = SAMPLER.process(logits, params, [3, 3], [1, 1, 2])
    np.testing.assert_allclose(processed, [0.0, -1.0, -0.75, 0.0])


def test_min_tokens_bans_the_end_id_until_reached():
    logits = np.array([5.0, 0.0, 0.0], dtype=np.float32)
    params = SamplingParams(end_id=0, min_tokens=2)
    assert draw(params, logits, output=[1])[0] != 0
    assert draw(params, logits, output=[1, 1])[0] == 0


def test_bad_words_single_and_multi_token():
    logits = np.array([3.0, 2.0, 1.0, 0.0], dtype=np.float32)
    params = SamplingParams(bad_words=[[0], [2, 1]])
    assert draw(params, logits, output=[3])[0] == 1          # 0 banned, prefix [2] absent
    assert draw(params, logits, output=[2])[0] == 2          # [2, 1]: 1 banned after 2
    assert draw(params, logits, prompt=[2])[0] == 2          # the prompt counts as history


def test_stop_words_finish_the_sequence_and_stay_in_the_output():
    assert StopWords([(9,), (5, 6)]).ends([4, 5, 6])
    assert not StopWords([(5, 6)]).ends([6])
    params = SamplingParams(max_tokens=10, stop_words=[[5, 6]], end_id=1)
    seq = Sequence("r", [3], params, 0, BlockTable(4), max_total=11)
    events = [seq.append(t, 0.0) for t in (5, 7, 5, 6)]
    assert [e.final for e in events] == [False, False, False, True]
    assert seq.finish_reason == "stop_word" and seq.output_ids == [5, 7, 5, 6]
    seq = Sequence("r", [3], params, 0, BlockTable(4), max_total=3)
    assert seq.append(1, 0.0).finish_reason == "stop"
    seq = Sequence("r", [3], params, 0, BlockTable(4), max_total=3)
    assert seq.append(7, 0.0).finish_reason is None
    assert seq.append(7, 0.0).finish_reason == "length"


def reference_ends(output_ids, stop_words):
    """The scan over every stop word that the indexed match replaced."""
    return any(len(output_ids) >= len(w) and tuple(output_ids[-len(w):]) == tuple(w)
               for w in stop_words)


def reference_bans(prompt_ids, output_ids, bad_words):
    """The scan over every bad word that the indexed match replaced: the banned ids."""
    history = list(prompt_ids) + list(output_ids)
    return {w[-1] for w in bad_words
            if not w[:-1] or tuple(history[-len(w[:-1]):]) == tuple(w[:-1])}


def test_indexed_word_matching_equals_the_full_scan():
    rng = random.Random(0)
    logits = np.zeros(6, dtype=np.float32)
    for _ in range(2000):
        words = [tuple(rng.randrange(6) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 5))]
        prompt = [rng.randrange(6) for _ in range(rng.randint(0, 4))]
        output = [rng.randrange(6) for _ in range(rng.randint(0, 6))]
        params = SamplingParams(stop_words=words, bad_words=words)
        assert params.stop_index.ends(output) == reference_ends(output, words)
        banned = set(np.flatnonzero(SAMPLER.process(logits, params, prompt, output) == -np.inf))
        assert banned == reference_bans(prompt, output, words), (words, prompt, output)


def test_logprobs_are_reported_only_when_asked():
    seq = Sequence("r", [3], SamplingParams(return_log_probs=True), 0, BlockTable(4), 10)
    assert seq.append(1, -0.5).log_probs == [-0.5]
    seq = Sequence("r", [3], SamplingParams(), 0, BlockTable(4), 10)
    assert seq.append(1, -0.5).log_probs is None


def test_word_lists_are_normalised_to_tuples():
    params = SamplingParams(stop_words=[[1, 2]], bad_words=[np.array([3])])
    assert params.stop_words == ((1, 2),) and params.bad_words == ((3,),)
    assert params.max_token_id() == 3
    hash(params)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": float("inf")}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"end_id": -2}, "end_id"),
    ({"stop_words": [[]]}, "stop_words"),
    ({"stop_words": [[1, -1]]}, "stop_words"),
    ({"bad_words": [["a"]]}, "bad_words"),
    ({"bad_words": 5}, "bad_words"),
    ({"stop_words": [[1]] * (MAX_WORDS + 1)}, "stop_words: 65 words"),
    ({"bad_words": [[1] * (MAX_WORD_TOKENS + 1)]}, r"bad_words\[0\]: 65 tokens"),
    ({"stop_words": [[1] * 60] * 18}, f"stop_words: 1080 tokens in all, at most {MAX_LIST_TOKENS}"),
    ({"return_log_probs": "yes"}, "return_log_probs"),
    ({"top_logprobs": 21}, r"top_logprobs must be an integer in \[0, 20\]"),
    ({"top_logprobs": -1}, "top_logprobs"),
])
def test_invalid_options_raise_a_user_error_naming_the_option(kwargs, message):
    with pytest.raises(SamplingParamsError, match=message) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, UserError)

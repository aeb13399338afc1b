"""Log-probs with their top-N alternatives through a real `serve all` (disaggregated: the
first token from the context, the rest from generation over the token wire) and the
official ``openai`` SDK, whole and streamed, against an in-process engine on the same prompt
ids; and ``usage.prompt_tokens`` as Hugging Face's tokenizer counts the prompt (its BOS
included for a completion, the chat template's text as it is for a chat). One server for
the module (tests/server/conftest.py's `server` and `client`)."""

from __future__ import annotations

import pytest

from servers import PROMPTS

MODEL = "engine"                 # the model id: the engine directory's name (conftest's)


@pytest.fixture(scope="module")
def expected(demo_engine):
    """``(prompt ids, max_tokens, k) -> (generated ids, their log-probs, their top k)`` of
    the in-process engine, greedy, stopping at eos as the server does."""
    from triton_disagg.engine.llm_engine import LLMEngine
    from triton_disagg.engine.sampling import SamplingParams
    from triton_disagg.engine.spec import EngineSpec

    eos = EngineSpec.load(demo_engine).eos_token_id
    engine = LLMEngine(demo_engine, num_blocks=512, prefix_caching=False)

    def run(ids: list[int], max_tokens: int, k: int):
        events = []
        engine.add_request("want", ids, SamplingParams(
            max_tokens=max_tokens, end_id=eos, return_log_probs=True, top_logprobs=k))
        while engine.has_unfinished():
            events += engine.step()
        if events[-1].tokens[0] == eos:
            events = events[:-1]           # the end token is not output
        return ([e.tokens[0] for e in events], [e.log_probs[0] for e in events],
                [e.top[0] if e.top else [] for e in events])
    return run


@pytest.fixture(scope="module")
def hf_tokenizer(demo_engine):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_engine)


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_completions_top_logprobs_are_the_engines_streamed_or_not(
        client, expected, hf_tokenizer, demo_engine, prompt):
    from triton_disagg.front.orchestrator_call import RequestEncoder

    text = RequestEncoder(demo_engine, MODEL).token_text
    ids = hf_tokenizer(prompt).input_ids
    want_ids, want_lps, want_top = expected(ids, 8, 5)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                      logprobs=5)
    assert whole.usage.prompt_tokens == len(ids)          # Hugging Face's count, BOS included
    lp = whole.choices[0].logprobs
    assert lp.tokens == [text(i) for i in want_ids]
    assert lp.token_logprobs == pytest.approx(want_lps, abs=1e-3)
    for got, chosen, lp_chosen, top in zip(lp.top_logprobs, want_ids, want_lps, want_top):
        want = {text(chosen): lp_chosen, **{text(i): v for i, v in zip(top.ids, top.logprobs)}}
        assert got == pytest.approx(want, abs=1e-3) and 5 <= len(got) <= 6
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                            temperature=0, logprobs=5, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.top_logprobs]
    assert len(streamed) == len(lp.top_logprobs)          # the second reads a cached prefix:
    for got, whole_top in zip(streamed, lp.top_logprobs):   # float rounding may differ
        assert got == pytest.approx(whole_top, abs=1e-3)


def test_chat_top_logprobs_are_the_engines_streamed_or_not(client, expected, demo_engine):
    from triton_disagg.front.tokenizer import Tokenizer
    from triton_disagg.front.chat_template import ChatTemplate

    tokenizer = Tokenizer(demo_engine)
    messages = [{"role": "user", "content": "The quick brown fox"}]
    ids = tokenizer.encode(ChatTemplate.load(demo_engine).render(messages),
                           add_special_tokens=False)     # the template's text, as vLLM
    want_ids, want_lps, want_top = expected(ids, 6, 20)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=20)
    assert whole.usage.prompt_tokens == len(ids)
    content = whole.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([i], False) for i in want_ids]
    assert [c.logprob for c in content] == pytest.approx(want_lps, abs=1e-3)
    for entry, top in zip(content, want_top):
        want = [(tokenizer.decode([i], False), v) for i, v in zip(top.ids, top.logprobs)]
        assert len(entry.top_logprobs) == 20
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.logprobs, abs=1e-3)
        for t in entry.top_logprobs:        # by text (two ids may share one); near-ties may swap
            assert any(t.token == text and abs(t.logprob - v) < 1e-3 for text, v in want), t
            assert t.bytes == list(t.token.encode())
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=20, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    for got, whole_entry in zip(streamed, content):
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(
            [t.logprob for t in whole_entry.top_logprobs], abs=1e-3)


def test_return_tokens_as_token_ids_names_the_engines_ids(client, server, expected,
                                                         hf_tokenizer):
    """vLLM's ``return_tokens_as_token_ids``: log-probs name each token ``token_id:N``, the
    engine's greedy ids (a byte of a character has no text of its own), over completions
    and chat; the bench's client reads them back (what ``bench prefix``'s chat resends)."""
    from triton_disagg.clients.stream import GenerateRequest, openai_generate

    ids = hf_tokenizer(PROMPTS[0]).input_ids
    want_ids, _, _ = expected(ids, 8, 0)
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                      logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    assert whole.choices[0].logprobs.tokens == [f"token_id:{i}" for i in want_ids]
    streamed = openai_generate(server.front, GenerateRequest(tuple(ids), 8, token_ids=True),
                               MODEL)
    assert streamed.token_ids == want_ids
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    assert all(c.token.startswith("token_id:") for c in chat.choices[0].logprobs.content)


def test_an_empty_prompt_is_the_bos_alone_as_in_hugging_face(client, hf_tokenizer):
    """``""`` tokenizes to the BOS the demo tokenizer adds (vLLM serves it too); a tokenizer
    that adds nothing leaves it empty, which preprocessing refuses."""
    got = client.completions.create(model=MODEL, prompt="", max_tokens=2, temperature=0)
    assert got.usage.prompt_tokens == len(hf_tokenizer("").input_ids) == 1


def _ensemble_stream(grpc: str, inputs: dict) -> list:
    """The ``ensemble``'s responses to one gRPC streaming request (tritonclient), up to the
    final one."""
    import queue

    import tritonclient.grpc as grpcclient

    from triton_disagg.clients.stream import array_inputs

    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(grpc) as triton:
        triton.start_stream(callback=lambda result, error: results.put((result, error)))
        triton.async_stream_infer("ensemble", array_inputs(inputs),
                                  enable_empty_final_response=True)
        responses = []
        while True:
            result, error = results.get(timeout=120)
            assert error is None, error
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        triton.stop_stream()
    return responses


def test_ensemble_top_logprobs_are_the_engines_over_tritonclient(server, expected, hf_tokenizer):
    """The ensemble's ``top_logprobs`` k: each streamed response carries, beside
    ``output_log_probs`` [1, n], ``output_top_ids`` and ``output_top_log_probs`` [1, n, k]:
    the engine's own alternatives for the same prompt ids; without it, neither."""
    import numpy as np

    prompt, k = "The quick brown fox", 3
    want_ids, want_lps, want_top = expected(hf_tokenizer(prompt).input_ids, 6, k)
    base = {"text_input": np.array([[prompt.encode()]], dtype=object),
            "max_tokens": np.array([[6]], dtype=np.int32),
            "stream": np.array([[True]], dtype=bool),
            "temperature": np.array([[0.0]], dtype=np.float32),
            "return_log_probs": np.array([[True]], dtype=bool)}
    responses = _ensemble_stream(server.grpc, {**base, "top_logprobs": np.array([[k]], np.int32)})
    carrying = [r for r in responses if r.as_numpy("output_log_probs") is not None]
    lps = np.concatenate([r.as_numpy("output_log_probs")[0, 0] for r in carrying])
    ids = np.concatenate([r.as_numpy("output_top_ids")[0, 0] for r in carrying])   # [n, k]
    top = np.concatenate([r.as_numpy("output_top_log_probs")[0, 0] for r in carrying])
    assert ids.shape == top.shape == (len(want_ids), k)
    assert lps == pytest.approx(want_lps, abs=1e-3)
    assert ids.tolist() == [t.ids for t in want_top]
    np.testing.assert_allclose(top, [t.logprobs for t in want_top], atol=1e-3)
    plain = _ensemble_stream(server.grpc, base)
    assert all(r.as_numpy("output_top_ids") is None for r in plain)
    assert any(r.as_numpy("output_log_probs") is not None for r in plain)

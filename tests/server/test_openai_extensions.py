"""What vLLM's and trtllm-serve's clients send to the HTTP front of a real `serve all` (the
demo engine), through the official ``openai`` SDK or as lm-eval posts it: log-probs
(completions and chat, lm-eval's loglikelihood with ``echo``), token-id prompts and lists
of prompts with ``n``, vLLM's sampling fields in the body (``top_k``, ``min_tokens``,
``repetition_penalty``, ``ignore_eos``), ``cache_salt``, ``models.retrieve``. One server
for the module (tests/server/conftest.py)."""

from __future__ import annotations

import json

import pytest
import requests

import servers
from front_server import MODEL, blocks_used
from servers import PROMPTS


def test_completion_logprobs_name_the_greedy_tokens(client, offline, tokenizer):
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12,
                                    temperature=0, logprobs=3)
    choice, want = got.choices[0], offline(PROMPTS[0], 12)
    lp = choice.logprobs
    assert choice.text == want and len(lp.tokens) == got.usage.completion_tokens
    whole = [t for t in lp.tokens if "\ufffd" not in t]     # not a part of a character
    assert whole and all(t in choice.text for t in whole)
    assert all(x <= 0 for x in lp.token_logprobs) and any(x < 0 for x in lp.token_logprobs)
    assert all(top[t] == max(top.values()) and len(top) <= 4         # chosen + 3 most likely
               for t, top in zip(lp.tokens, lp.top_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12,
                                              temperature=0, logprobs=1, stream=True))
    assert [x for c in streamed if c.choices[0].logprobs
            for x in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs)


def test_lm_eval_loglikelihood_request_gets_the_prompts_log_probs(server, demo_engine,
                                                                   tokenizer):
    """lm-eval ``local-completions``' loglikelihood payload, as it sends it (token ids, two
    prompts in one request): each choice lists its prompt's tokens (null first) then the one
    generated, with the log-probs an in-process engine computes, and lm-eval's is_greedy
    (the prompt token's log-prob is the top one) where the token is the engine's argmax;
    twice, so that the second reads a prefix the first cached (it must not)."""
    from triton_disagg.engine.llm_engine import LLMEngine
    from triton_disagg.engine.sampling import SamplingParams

    prompts = [tokenizer.encode(PROMPTS[0]), tokenizer.encode(PROMPTS[1])]
    engine = LLMEngine(demo_engine, num_blocks=512, prefix_caching=False)
    want = engine.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1))
    for _ in range(2):
        resp = requests.post(f"{server.front}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True})
        assert resp.status_code == 200, resp.text
        choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
        for choice, prompt, seq in zip(choices, prompts, want):
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(prompt) + 1 == len(lp["tokens"])
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert lp["token_logprobs"][1:-1] == pytest.approx(
                seq.prompt_logprobs.chosen.tolist(), abs=1e-3)
            greedy = [tok == max(top.values()) for tok, top in
                      zip(lp["token_logprobs"][1:-1], lp["top_logprobs"][1:-1])]
            assert greedy == (seq.prompt_logprobs.top_ids[:, 0] == prompt[1:]).tolist()
            assert not all(greedy) and all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])


def test_chat_logprobs_and_top_logprobs(client):
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert "".join(c.token for c in content) == got.choices[0].message.content
    assert len(content) == got.usage.completion_tokens
    assert all(c.logprob <= 0 and len(c.top_logprobs) == 2     # greedy: the chosen first
               and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)


@pytest.mark.parametrize("wrap", [lambda ids: ids, lambda ids: [ids]])
def test_token_id_prompts_answer_as_their_text(client, offline, tokenizer, wrap):
    ids = tokenizer.encode(PROMPTS[1])
    got = client.completions.create(model=MODEL, prompt=wrap(ids), max_tokens=10, temperature=0)
    assert got.choices[0].text == offline(PROMPTS[1], 10)
    assert got.usage.prompt_tokens == len(ids)


def test_bad_token_ids_and_refused_fields_are_named(client, tokenizer):
    import openai

    with pytest.raises(openai.BadRequestError, match="not in this model's vocabulary") as err:
        client.completions.create(model=MODEL, prompt=[1, tokenizer.vocab_size], max_tokens=2)
    assert err.value.param == "prompt" and err.value.code == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="min_p"):
        client.completions.create(model=MODEL, prompt="a", extra_body={"min_p": 0.1})
    with pytest.raises(openai.BadRequestError, match="max_seq_len") as err:
        client.completions.create(model=MODEL, prompt="a " * 5000, max_tokens=2)
    assert err.value.param == "prompt"


def test_vllm_sampling_fields_in_the_body(client, offline):
    greedy = offline(PROMPTS[0], 12)

    def text(**extra):
        got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12,
                                        **extra)
        return got.choices[0].text, got.usage.completion_tokens
    # vLLM's bench serve sends repetition_penalty 1.0 on every completions request
    assert text(temperature=0, extra_body={"repetition_penalty": 1.0})[0] == greedy
    assert text(temperature=0, extra_body={"repetition_penalty": 1.8})[1] > 0   # accepted
    assert text(temperature=1.0, extra_body={"top_k": 1})[0] == greedy      # top-1 is greedy
    assert text(temperature=1.0, seed=11, extra_body={"top_k": -1}) == \
        text(temperature=1.0, seed=11, extra_body={"top_k": -1})
    assert text(temperature=0, extra_body={"ignore_eos": True})[1] == 12
    assert text(temperature=0, extra_body={"min_tokens": 12})[1] == 12


def test_echo_models_retrieve_and_usage_null(server, client):
    got = client.completions.create(model=MODEL, prompt="Once", max_tokens=3, temperature=0,
                                    echo=True)
    assert got.choices[0].text.startswith("Once") and len(got.choices[0].text) > 4
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_dump()["root"] == MODEL
    resp = requests.post(f"{server.front}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "a", "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = [json.loads(l[len("data: "):]) for l in resp.text.split("\n\n") if "{" in l]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    metrics = requests.get(f"{server.front}/metrics", timeout=10).text
    assert 'disagg_front_requests_total{route="/v1/completions",status="200"}' in metrics


def test_several_prompts_and_n_are_indexed_choices(client, offline, tokenizer):
    ids = tokenizer.encode(PROMPTS[1])
    got = client.completions.create(model=MODEL, prompt=[PROMPTS[0], ids], n=2, max_tokens=6,
                                    temperature=0)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [offline(PROMPTS[0], 6)] * 2 + \
        [offline(PROMPTS[1], 6)] * 2
    assert got.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[0])) + len(ids)
    chat = client.chat.completions.create(model=MODEL, n=2, max_tokens=4, temperature=1.0,
                                          seed=3, messages=[{"role": "user", "content": "hi"}])
    assert [c.index for c in chat.choices] == [0, 1]


def test_a_cache_salt_shares_a_prefix_only_within_its_tenant(server, client, offline):
    """vLLM's ``cache_salt`` through the OpenAI SDK: a long prefix sent twice under one salt
    is served from the context's prefix cache the second time (``usage`` says how many
    tokens, and the context's hit counter grows by as many), under another salt it is
    prefilled again; the greedy text is the uncached one either way."""
    from triton_disagg.routing.scrape import scrape, total

    prompt = "Every tenant repeats this long system prompt before its question. " * 4

    def hits() -> float:
        return total(scrape(server.metrics), "disagg_prefix_cache_hits_total", role="context")

    def ask(salt: str) -> int:
        """The prompt tokens served from cache, as the request's usage reports them."""
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                        temperature=0, extra_body={"cache_salt": salt})
        assert got.choices[0].text == offline(prompt, 6)
        return got.usage.prompt_tokens_details.cached_tokens

    before = hits()
    assert ask("tenant-a") == 0
    hit = ask("tenant-a")
    assert hit >= 32                      # at least two blocks of the prefix came from cache
    assert ask("tenant-b") == 0
    # the context counted them too (its counters are published every half second, and other
    # tests' requests may land in the same window: at least what usage said)
    servers.wait_until(lambda: hits() >= before + hit, 10, "the context's hits published",
                       poll=0.1)
    servers.wait_until(lambda: blocks_used(server) == 0, 10, "no block held at rest")

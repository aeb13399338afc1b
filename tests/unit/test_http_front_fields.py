"""OpenAI's and vLLM's fields through the HTTP front's aiohttp app in this process, its relay
scripted (:mod:`scripted_relay`): log-probs, ``echo``, ``models.retrieve``, the OpenAPI
document against the request models, several prompts and ``n``, and the body `vllm bench
serve` sends."""

from __future__ import annotations

import json

import pytest

from scripted_relay import WORDS, ScriptedRelay, response, run
from triton_disagg.errors import ErrorCode
from triton_disagg.front.openai_api import ApiError
from triton_disagg.front.orchestrator_call import OrchestratorError, RequestEncoder


LOGPROB_WORDS = [response("Hello", 3, 1, (10,), (-0.5,)),
                 response(" world", 3, 3, (11, 12), (-1.0, -2.0), finish_reason="length")]


def test_logprobs_of_completions_and_chat_name_each_token(demo_engine):
    """The orchestrator's output_ids/output_log_probs as OpenAI's objects, whole or streamed."""
    preparer = RequestEncoder(demo_engine, "demo")
    names = [preparer.token_text(i) for i in (10, 11, 12)]

    async def check(client):
        resp = await client.post("/v1/completions", json={
            "model": "demo", "prompt": "ab", "max_tokens": 3, "logprobs": 2, "echo": False})
        logprobs = (await resp.json())["choices"][0]["logprobs"]
        assert logprobs["tokens"] == names
        assert logprobs["token_logprobs"] == [-0.5, -1.0, -2.0]
        assert logprobs["top_logprobs"] == [{n: lp} for n, lp in zip(names, [-0.5, -1.0, -2.0])]
        assert logprobs["text_offset"] == [0, len(names[0]), len(names[0]) + len(names[1])]
        resp = await client.post("/v1/chat/completions", json={
            "model": "demo", "messages": [{"role": "user", "content": "a"}], "max_tokens": 3,
            "logprobs": True, "top_logprobs": 1, "stream": True})
        chunks = [json.loads(l[len("data: "):]) for l in (await resp.text()).split("\n\n")
                  if l.startswith("data: {")]
        content = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                   for e in c["choices"][0]["logprobs"]["content"]]
        assert [e["token"] for e in content] == names
        assert [e["logprob"] for e in content] == [-0.5, -1.0, -2.0]
        assert content[0]["bytes"] == list(names[0].encode())
        assert content[0]["top_logprobs"] == []     # none came (test_top_logprobs_front)
    run(ScriptedRelay(LOGPROB_WORDS), check, demo_engine)


def test_echo_with_logprobs_lists_the_prompt_tokens_then_the_generated(demo_engine):
    """lm-eval's loglikelihood request: the prompt's tokens (null first, each with its
    alternatives and its own log-prob), then the generated token, offsets running on."""
    import numpy as np

    from triton_disagg.engine.prompt_logprobs import PromptLogprobs

    preparer = RequestEncoder(demo_engine, "demo")
    prompt = [5, 6, 7]
    given = PromptLogprobs(np.array([-1.5, -0.25], np.float32),
                           np.array([[9, 6], [7, 3]], np.int32),       # [n-1, k]: 6 not the best
                           np.array([[-0.5, -1.5], [-0.25, -2.0]], np.float32))
    first = response("x", 3, 1, (10,), (-0.75,), finish_reason="length", prompt_logprobs=given)
    text = [preparer.token_text(i) for i in prompt + [10]]
    alt = preparer.token_text(9)

    async def check(client):
        resp = await client.post("/v1/completions", json={
            "model": "demo", "prompt": [prompt], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True})
        logprobs = (await resp.json())["choices"][0]["logprobs"]
        assert logprobs["tokens"] == text
        assert logprobs["token_logprobs"] == [None, -1.5, -0.25, -0.75]
        assert logprobs["top_logprobs"] == [None, {alt: -0.5, text[1]: -1.5}, {text[2]: -0.25},
                                            {text[3]: -0.75}]
        assert logprobs["text_offset"] == [sum(len(t) for t in text[:i]) for i in range(4)]
        # lm-eval's parse_logprobs: greedy where the prompt's token is the most likely
        greedy = [tok == max(top.values()) for tok, top in
                  zip(logprobs["token_logprobs"][1:-1], logprobs["top_logprobs"][1:-1])]
        assert greedy == [False, True]
    run(ScriptedRelay([first]), check, demo_engine)


def test_echo_starts_the_text_with_the_prompt(demo_engine):
    async def check(client):
        body = {"model": "demo", "prompt": "Say: ", "max_tokens": 3, "echo": True}
        whole = await (await client.post("/v1/completions", json=body)).json()
        assert whole["choices"][0]["text"] == "Say: Hello 世界 🎉"
        resp = await client.post("/v1/completions", json={**body, "stream": True})
        chunks = [json.loads(l[len("data: "):]) for l in (await resp.text()).split("\n\n")
                  if l.startswith("data: {")]
        assert chunks[0]["choices"][0]["text"] == "Say: "
        assert "".join(c["choices"][0]["text"] for c in chunks) == "Say: Hello 世界 🎉"
    run(ScriptedRelay(WORDS), check, demo_engine)


def test_models_retrieve_and_root(demo_engine):
    async def check(client):
        listed = (await (await client.get("/v1/models")).json())["data"]
        assert [(m["id"], m["root"]) for m in listed] == [("demo", "demo")]
        one = await client.get("/v1/models/demo")
        assert one.status == 200 and await one.json() == listed[0]
        other = await client.get("/v1/models/org/other")
        body = await other.json()
        assert other.status == 404 and body["error"]["code"] == "model_not_found"
        assert body["error"]["param"] == "model"
    run(ScriptedRelay(WORDS), check, demo_engine)


ACCEPTED = [("completions", {"model": "demo", "prompt": [[5, 6]], "logprobs": 2, "top_k": -1,
                             "repetition_penalty": 1.0, "n": 1, "stop": ["x"]}),
            ("chat", {"model": "demo", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "a"}]}], "logprobs": True, "top_logprobs": 3}),
            ("inference", {"prompt": "Hello, world!", "model": "demo", "top_k": 4})]
REFUSED = [("completions", {"model": "demo", "prompt": [5, 2**20]}),
           ("completions", {"model": "demo", "prompt": "a", "min_p": 0.5}),
           ("completions", {"model": "demo", "prompt": "a", "frobnicate": 1}),
           ("chat", {"model": "demo", "messages": []}),
           ("inference", {"model": "demo"})]


def test_the_openapi_document_covers_every_route_and_checks_as_parse_does(demo_engine):
    """GET /openapi.json: every route the app serves is in it, and its body schemas accept
    what parse accepts and refuse what parse refuses (samples)."""
    import jsonschema

    from triton_disagg.front.openai_api import parse

    preparer = RequestEncoder(demo_engine, "demo")

    async def check(client):
        resp = await client.get("/openapi.json")
        doc = await resp.json()
        assert resp.status == 200 and doc["openapi"] == "3.1.0"
        routes = {(r.method.lower(), r.resource.canonical) for r in client.app.router.routes()
                  if r.method in ("GET", "POST")}
        documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
        assert routes == documented
        def schema(endpoint: str) -> dict:      # the body's, its $refs into the document's
            path = "/v1/" + endpoint.replace("chat", "chat/completions")
            body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
            return {**body["schema"], "components": doc["components"]}
        for endpoint, body in ACCEPTED:
            parse(endpoint, body, preparer.limits)
            jsonschema.validate(body, schema(endpoint))
        for endpoint, body in REFUSED:
            with pytest.raises(ApiError):
                parse(endpoint, body, preparer.limits)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(body, schema(endpoint))
    run(ScriptedRelay(WORDS), check, demo_engine)


def test_several_prompts_and_n_answer_as_indexed_choices(demo_engine):
    relay = ScriptedRelay(WORDS)

    async def check(client):
        resp = await client.post("/v1/completions", json={
            "model": "demo", "prompt": [[5, 6], "b"], "n": 2, "max_tokens": 3},
            headers={"X-Request-Id": "many"})
        body = await resp.json()
        assert resp.status == 200, body
        assert [(c["index"], c["text"]) for c in body["choices"]] == \
            [(i, "Hello 世界 🎉") for i in range(4)]
        # each prompt counted once (the relay says 3 prompt tokens), every choice's tokens
        assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 12,
                                 "total_tokens": 18, "prompt_tokens_details": {"cached_tokens": 0}}
        assert sorted(relay.request_ids) == [f"many-{i}" for i in range(4)]
    run(relay, check, demo_engine)


def test_a_failing_choice_fails_the_request_and_stops_the_others(demo_engine):
    relay = ScriptedRelay([response("a", 1, 1), OrchestratorError("internal error: x",
                                                               ErrorCode.INTERNAL)],
                          pause=0.05)

    async def check(client):
        resp = await client.post("/v1/completions", json={
            "model": "demo", "prompt": "a", "n": 3, "max_tokens": 3})
        assert resp.status == 500 and "internal error" in (await resp.json())["error"]["message"]
        assert len(relay.left_early) == 3        # every stream ended, none left open
    run(relay, check, demo_engine)


def test_vllm_bench_serves_completions_body_is_served(demo_engine):
    """The body `vllm bench serve --backend openai` sends (vllm/benchmarks/lib/
    endpoint_request_func.py): repetition_penalty 1.0 and logprobs null on every request."""
    async def check(client):
        resp = await client.post("/v1/completions", json={
            "model": "demo", "prompt": "a b c", "temperature": 0.0, "repetition_penalty": 1.0,
            "max_tokens": 3, "logprobs": None, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}})
        text = await resp.text()
        assert resp.status == 200 and text.endswith("data: [DONE]\n\n"), text
    run(ScriptedRelay(WORDS), check, demo_engine)

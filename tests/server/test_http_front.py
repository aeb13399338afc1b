"""The HTTP front of a real `serve all` (disaggregated, the demo engine), called as its users
call it: the official ``openai`` SDK (completions and chat, streaming and not), the
deployment guide's ``requests.post(.../v1/inference)``, raw HTTP for bad inputs; greedy
text equals the offline engine's, Chinese and emoji included; a client that disconnects
frees its KV blocks. One server for the module (a start costs ~20 s)."""

from __future__ import annotations

import json

import pytest
import requests

import servers
from servers import PROMPTS

MODEL = "engine"                 # the model id: the engine directory's name (conftest's)


@pytest.fixture(scope="module")
def server(demo_engine, tmp_path_factory):
    assert demo_engine.name == MODEL, "the front serves the engine directory's name"
    work = tmp_path_factory.mktemp("serve-front")
    config = work / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\nkv_cache: {{max_size: 16MB}}\n")
    with servers.serve("all", ["-c", str(config)], work / "run") as served:
        yield served


@pytest.fixture(scope="module")
def offline(demo_engine):
    return servers.offline_text(demo_engine)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.front}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def chat_prompt(demo_engine):
    from triton_disagg.front.chat_template import ChatTemplate

    return lambda text: ChatTemplate.load(demo_engine).render([{"role": "user", "content": text}])


def _blocks_used(served) -> float:
    from triton_disagg.routing.scrape import scrape, total

    return total(scrape(served.metrics), "disagg_kv_blocks_used")


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    for path in ("/healthz", "/health"):
        resp = requests.get(server.front + path, timeout=10)
        assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    assert requests.get(server.front + "/version", timeout=10).json()["model"] == MODEL


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_greedy_equals_offline_streamed_or_not(client, offline, prompt):
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert whole.choices[0].text == offline(prompt, 20)
    assert whole.usage.completion_tokens <= 20 and whole.usage.prompt_tokens > 0
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                            temperature=0, stream=True))
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.parametrize("text", PROMPTS[1:3])
def test_chat_greedy_equals_offline_on_the_templated_prompt(client, offline, chat_prompt, text):
    messages = [{"role": "user", "content": text}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                           temperature=0)
    # the template's text as it is: no BOS added (vLLM's add_special_tokens=False for chat)
    assert whole.choices[0].message.content == offline(chat_prompt(text), 16, False)
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages,
                                            max_completion_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_the_final_response_says_why_the_request_ended(server, client):
    """The ensemble's final response carries ``finish_reason`` (``protocol.FinishReason``),
    and the front passes that on in OpenAI's words."""
    import queue

    import tritonclient.grpc as grpcclient

    from triton_disagg.clients.stream import GenerateRequest, grpc_inputs

    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc) as triton:
        triton.start_stream(callback=lambda result, error: results.put((result, error)))
        triton.async_stream_infer("ensemble", grpc_inputs(GenerateRequest(
            PROMPTS[0], 3, stream=False, options={"end_id": -1})))
        result, error = results.get(timeout=120)
        triton.stop_stream()
    assert error is None and result.as_numpy("finish_reason").reshape(-1).tolist() == [b"length"]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length"


def test_stop_sequence_ends_the_text_and_is_left_out(client, offline):
    full = offline(PROMPTS[0], 20)
    stop = full[5:9]
    assert stop.strip() and full.index(stop) == 5
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20,
                                    temperature=0, stop=[stop])
    assert got.choices[0].text == full[:5] and got.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(client):
    def draw():
        return client.completions.create(model=MODEL, prompt="a", max_tokens=12,
                                         temperature=1.0, top_p=0.9, seed=7).choices[0].text
    assert draw() == draw()


def test_the_guides_inference_request_prints_text(server, offline):
    # the deployment guide's verification request, as written there (plus a timeout)
    response = requests.post(f"{server.front}/v1/inference",
                             json={"prompt": "Hello, world!", "model": MODEL}, timeout=60)
    print(response.json())
    assert response.status_code == 200
    assert response.json()["text"] == offline("Hello, world!", 16)


@pytest.mark.parametrize("send, status, words", [
    (dict(data=b"{oops"), 400, "not valid JSON"),
    (dict(json={"model": MODEL, "prompt": 3}), 400, "'prompt'"),
    (dict(json={"model": MODEL, "prompt": "a", "nonsense": 1}), 400, "'nonsense'"),
    (dict(json={"model": MODEL, "prompt": "a", "n": 9}), 400, "'n'"),
    (dict(json={"model": MODEL, "prompt": "a", "max_tokens": 99999}), 400, "max_seq_len"),
    (dict(json={"model": MODEL, "prompt": []}), 400, "non-empty"),   # "" is [BOS]: served
    (dict(json={"model": "gpt-4o", "prompt": "a"}), 404, "not found"),
    (dict(data=b"x" * (11 * 2**20)), 413, "over"),
])
def test_bad_inputs_get_4xx_openai_errors_and_the_server_serves_on(server, client, send,
                                                                   status, words):
    resp = requests.post(f"{server.front}/v1/completions", timeout=60,
                         headers={"Content-Type": "application/json", "X-Request-Id": "bad-1"},
                         **send)
    assert resp.status_code == status, resp.text
    assert words in resp.json()["error"]["message"]
    assert resp.headers["X-Request-Id"] == "bad-1"
    assert client.completions.create(model=MODEL, prompt="a", max_tokens=2).choices


def test_sdk_raises_the_openai_error(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL, prompt="a", top_p=5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "a"}])


def _cancelled(served) -> float:
    from triton_disagg.routing.scrape import scrape, total

    return total(scrape(served.metrics), "disagg_requests_total", outcome="cancelled",
                 role="orchestrator")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_and_frees_its_blocks(server, stream):
    """The orchestrator counts the request ``cancelled`` (a request that ran to its 1500
    tokens counts ``finished``), and the KV blocks return to 0. Generous waits: the
    machine may be busy."""
    cancelled = _cancelled(server)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0,
            "stream": stream}
    if stream:
        with requests.post(f"{server.front}/v1/completions", stream=True, timeout=60,
                           json=body) as resp:
            lines = resp.iter_lines()
            for _ in range(3):
                line = next(line for line in lines if line)
                assert json.loads(line[len(b"data: "):])["choices"]
            servers.wait_until(lambda: _blocks_used(server) > 0, 60,   # the gauge: every 0.5 s
                               "the request holds KV blocks")
    else:
        import http.client

        host, port = server.front.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        servers.wait_until(lambda: _blocks_used(server) > 0, 60, "the request holds KV blocks")
        conn.close()                           # before any answer: the client is gone
    servers.wait_until(lambda: _cancelled(server) == cancelled + 1, 60,
                       "the orchestrator counts the request cancelled", poll=0.1)
    servers.wait_until(lambda: _blocks_used(server) == 0, 60, "KV blocks back to 0", poll=0.1)


def test_bench_front_paths_send_the_same_requests(server, demo_engine):
    """`bench front`'s two senders against this server: every reply complete, with exactly
    its max_tokens tokens (end id off), over gRPC and over the front alike."""
    import math
    import random

    from triton_disagg.clients.load import run_load, run_openai_load
    from triton_disagg.clients.stream import GenerateRequest

    rng = random.Random(0)
    requests_ = [GenerateRequest(PROMPTS[i % len(PROMPTS)], rng.randint(4, 12), True,
                                 {"end_id": -1}) for i in range(6)]
    for run in (run_load(server.grpc, requests_, math.inf),
                run_openai_load(server.front, MODEL, requests_, math.inf)):
        assert [o.error for o in run.outcomes] == [None] * len(requests_)
        assert [o.measurement.output_tokens for o in run.outcomes] == \
            [r.max_tokens for r in requests_]
        assert all(o.measurement.ttft > 0 for o in run.outcomes)


def _front_argv(server, demo_engine, port: int) -> list[str]:
    import sys

    return [sys.executable, "-m", "triton_disagg.front.http_front", "--engine", str(demo_engine),
            "--model-name", MODEL, "--grpc-url", server.grpc, "--port", str(port)]


def _wait_healthy(url: str) -> None:
    def healthy() -> bool:
        try:
            return requests.get(f"{url}/healthz", timeout=1).status_code == 200
        except requests.ConnectionError:
            return False
    servers.wait_until(healthy, 60, f"{url}/healthz answers 200", poll=0.1)


def test_the_front_stops_cleanly_on_sigterm(server, demo_engine):
    import subprocess

    (port,) = servers.free_ports(1)
    proc = subprocess.Popen(_front_argv(server, demo_engine, port), stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}")
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_the_front_exits_when_its_parent_is_killed(server, demo_engine):
    """serve stops the front; should serve be SIGKILLed, the front notices and exits."""
    import os
    import signal
    import subprocess
    import sys

    (port,) = servers.free_ports(1)
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen({_front_argv(server, demo_engine, port)!r})\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    front = int(parent.stdout.readline())
    try:
        _wait_healthy(f"http://127.0.0.1:{port}")
        parent.kill()
        parent.wait()
        servers.wait_until(lambda: not os.path.exists(f"/proc/{front}") or
                           "zombie" in open(f"/proc/{front}/status").read(), 10,
                           "the front exits without its parent", poll=0.1)
    finally:
        parent.kill()
        if os.path.exists(f"/proc/{front}"):
            os.kill(front, signal.SIGKILL)


# ---- what vLLM's and trtllm-serve's clients send (issue 30) ---------------------------------

@pytest.fixture(scope="module")
def tokenizer(demo_engine):
    from triton_disagg.engine.tokenizer import Tokenizer

    return Tokenizer(demo_engine)


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
    servers.wait_until(lambda: _blocks_used(server) == 0, 10, "no block held at rest")

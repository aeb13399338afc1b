"""Every public entry of one real ``serve all`` (the demo engine) fed malformed, oversized and
hostile input: the HTTP front's ``/v1/completions``, ``/v1/chat/completions``,
``/v1/inference``, ``/v1/models`` and ``/healthz``; Triton's HTTP ``generate`` and its gRPC
streaming ``ModelInfer`` on the public ``ensemble``; the ``orchestrator`` called
directly (not an entry a client should use: an error is the right answer, whatever its
words). Fixed hostile cases first, then JSON bodies drawn by ``hypothesis``, derandomized
(the same bodies on every run).

Every answer is a 4xx (or a 2xx for what happens to be a valid request) or, over a gRPC
stream (which carries no status code), a one-line error without a traceback, within
``ANSWER_SECONDS``; never a 5xx from bad input, except Triton's own: its HTTP ``generate``
parser (C++, before any model runs) answers 500 "Unable to parse ..." for a value of the wrong
JSON type ("attempt to access JSON non-string as string") or an integer over 2**63 - 1
(``TRITON_PARSE_500``; the front, which checks every field itself, is the entry to give
clients). KServe ``infer`` over HTTP is not an entry here: Triton answers 501
for every call to a decoupled model. Afterwards the server
still serves, its KV pools hold 0 blocks, and no process of the server (tritonserver, its
stubs, the front) grew by more than ``RSS_GROWTH_BOUND`` bytes of resident memory.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import servers
from servers import PROMPTS
from triton_disagg.routing.scrape import scrape, total

MODEL = "engine"                    # the front's model id: the engine directory's name
ANSWER_SECONDS = 15.0               # per hostile request, on a busy 2-core machine
RSS_GROWTH_BOUND = 256 * 2**20
FRONT_GENERATE = ("/v1/completions", "/v1/chat/completions", "/v1/inference")
MiB = 2**20
CAP = 8                             # the front's max_concurrent_requests here


@pytest.fixture(scope="module")
def server(demo_engine, tmp_path_factory):
    work = tmp_path_factory.mktemp("fuzz")
    with servers.serve_config(f"model: {{engine: {demo_engine}}}\n"
                              "kv_cache: {max_size: 16MB}\n"
                              f"front: {{max_concurrent_requests: {CAP}}}\n", work) as served:
        yield served


def _rss(work_dir) -> dict[int, int]:
    """pid -> resident bytes (VmRSS) of every live process of the server under ``work_dir``."""
    out = {}
    for line in servers.processes_under(work_dir):
        pid = int(line.split(":", 1)[0])
        try:
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        kib = next((l.split()[1] for l in status.splitlines() if l.startswith("VmRSS:")), None)
        if kib is not None:
            out[pid] = int(kib) * 1024
    return out


@pytest.fixture(scope="module")
def rss_before(server):
    return _rss(server.work_dir)


def _post(url: str, data: bytes, headers: dict | None = None) -> requests.Response:
    began = time.monotonic()
    resp = requests.post(url, data=data, timeout=ANSWER_SECONDS,
                         headers={"Content-Type": "application/json", **(headers or {})})
    assert time.monotonic() - began < ANSWER_SECONDS
    return resp


TRITON_PARSE_500 = '{"error":"Unable to parse '  # Triton's generate parser (docstring)


def _refused_cleanly(resp: requests.Response, allow_ok: bool = False) -> None:
    """A 4xx (a 2xx too with ``allow_ok``) whose body is JSON naming an error."""
    if resp.status_code == 500 and resp.text.startswith(TRITON_PARSE_500):
        return                          # Triton's own parser (module docstring)
    assert resp.status_code < 500, (resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        assert "error" in resp.json(), resp.text[:300]
    else:
        assert allow_ok, resp.text[:300]


# ---- the HTTP front: fixed hostile cases --------------------------------------------------

HOSTILE_BODIES = [
    b"", b"{", b"null", b"[]", b"\"a\"", b"\xff\xfe\x00", b"{\"prompt\": \"\xff\"}",
    b"[" * 50_000 + b"]" * 50_000,
    b'{"model": "engine", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"model": "engine", "prompt": "a", "max_tokens": NaN}',
    b'{"model": "engine", "prompt": "a", "temperature": Infinity}',
    json.dumps({"model": MODEL, "prompt": "a", "max_tokens": -1}).encode(),
    json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 2**31}).encode(),
    json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 2**64 + 1}).encode(),
    json.dumps({"model": MODEL, "prompt": "a", "top_k": 2**40}).encode(),
    json.dumps({"model": MODEL, "prompt": "a", "seed": -1}).encode(),
    json.dumps({"model": MODEL, "prompt": "a", "stop": ["x"] * 100_000}).encode(),
    json.dumps({"model": MODEL, "prompt": "a", "stop": ["x" * 100_000]}).encode(),
    json.dumps({"model": MODEL, "prompt": "a " * 2_000_000}).encode(),
    json.dumps({"model": MODEL, "prompt": ["a"] * 100_000}).encode(),
    json.dumps({"model": MODEL, "prompt": {"a": 1}, "n": 2**70}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}] * 100_000}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a " * 2_000_000}]}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [1] * 2_000_000}]}).encode(),
    json.dumps({"model": MODEL, "prompt": "a", **{f"k{i}": 1 for i in range(500_000)}}).encode(),
    json.dumps({"model": MODEL, "prompt": "a", "logit_bias": {str(i): 1 for i in range(50_000)}}).encode(),
    b"x" * (11 * MiB),
]


@pytest.mark.parametrize("path", FRONT_GENERATE)
def test_front_refuses_hostile_bodies_with_4xx(server, rss_before, path):
    for data in HOSTILE_BODIES:
        _refused_cleanly(_post(server.front + path, data))


@pytest.mark.parametrize("method, path, headers, data", [
    ("POST", "/v1/completions", {"Content-Type": "text/plain"}, b"hello"),
    ("POST", "/v1/completions", {"Content-Type": "multipart/form-data; boundary=x"}, b"--x--"),
    ("POST", "/v1/completions", {"Content-Type": "application/x-www-form-urlencoded"}, b"a=1"),
    ("POST", "/v1/completions", {"Content-Encoding": "gzip"}, b"not gzip"),
    ("POST", "/v1/completions", {"X-Big": "a" * 20_000}, b"{}"),
    ("POST", "/v1/completions", {"Origin": "http://evil.example"}, b"{}"),
    ("POST", "/v1/completions", {"Host": "rebound.example"}, b"{}"),
    ("GET", "/v1/completions", {}, b""),
    ("POST", "/v1/models", {}, b"{}"),
    ("POST", "/healthz", {}, b"{}"),
    ("GET", "/v1/../../etc/passwd", {}, b""),
    ("GET", "/v1/models?" + "a=1&" * 5000, {}, b""),
    ("PUT", "/v1/inference", {}, b"{}"),
])
def test_front_refuses_hostile_requests_with_4xx(server, rss_before, method, path, headers,
                                                 data):
    resp = requests.request(method, server.front + path, data=data, headers=headers,
                            timeout=ANSWER_SECONDS)
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])


def test_front_get_routes_ignore_bodies_and_queries(server, rss_before):
    for path in ("/v1/models", "/healthz", "/health", "/version"):
        resp = requests.get(server.front + path + "?x=" + "%ff" * 100, data=b"[" * 10_000,
                            timeout=ANSWER_SECONDS)
        assert resp.status_code == 200, resp.text[:300]


# ---- the HTTP front: drawn bodies ---------------------------------------------------------

_INTS = st.one_of(st.integers(-3, 8), st.integers(min_value=2**31 - 2),
                  st.integers(max_value=-2**31))
_LEAVES = st.one_of(st.none(), st.booleans(), _INTS, st.floats(), st.text(max_size=40))
_VALUES = st.recursive(_LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream",
           "stream_options", "stop", "temperature", "top_p", "top_k", "seed",
           "presence_penalty", "frequency_penalty", "user", "ignore_eos", "n", "logprobs",
           "echo", "tools", "response_format", "logit_bias", "suffix", "junk"]
_MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "robot"]),
     "content": st.one_of(st.text(max_size=40), _VALUES)}), max_size=3)
_BODIES = st.fixed_dictionaries(
    {"max_tokens": st.one_of(st.integers(1, 8), _VALUES)},
    optional={"model": st.one_of(st.just(MODEL), _VALUES), "prompt": st.one_of(
        st.text(max_size=40), _VALUES), "messages": st.one_of(_MESSAGES, _VALUES)},
).flatmap(lambda base: st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=3).map(
    lambda extra: {**extra, **base}))
_SETTINGS = settings(max_examples=40, derandomize=True, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])


@pytest.mark.parametrize("path", FRONT_GENERATE)
def test_front_answers_drawn_bodies_with_2xx_or_4xx(server, rss_before, path):
    @_SETTINGS
    @given(body=_BODIES)
    def check(body):
        data = json.dumps(body, allow_nan=True).encode()
        resp = _post(server.front + path, data)
        _refused_cleanly(resp, allow_ok=True)
        if resp.status_code == 200 and body.get("stream") is True:
            assert "data: [DONE]" in resp.text or '"error"' in resp.text
    check()


# ---- Triton: HTTP generate / infer and gRPC on the ensemble -------------------------------

_TRITON_FIELDS = ["text_input", "max_tokens", "stream", "end_id", "pad_id", "top_k", "top_p",
                  "temperature", "seed", "min_tokens", "repetition_penalty", "stop_words",
                  "bad_words", "beam_width", "exclude_input_in_output", "return_log_probs",
                  "junk"]
_TRITON_BODIES = st.fixed_dictionaries(
    {"max_tokens": st.one_of(st.integers(1, 8), _VALUES)},
    optional={"text_input": st.one_of(st.text(max_size=40), _VALUES)},
).flatmap(lambda base: st.dictionaries(st.sampled_from(_TRITON_FIELDS), _VALUES,
                                       max_size=3).map(lambda extra: {**extra, **base}))


def test_triton_generate_answers_drawn_bodies_with_2xx_or_4xx(server, rss_before):
    @_SETTINGS
    @given(body=_TRITON_BODIES)
    def check(body):
        body.pop("stream", None)        # generate (not generate_stream) wants one response
        resp = _post(f"{server.http}/v2/models/ensemble/generate",
                     json.dumps(body, allow_nan=True).encode())
        _refused_cleanly(resp, allow_ok=True)
    check()


@pytest.mark.parametrize("body", [
    {"text_input": "a", "max_tokens": 2**31 - 1},
    {"text_input": "a", "max_tokens": -5},
    {"text_input": "a" * 3_000_000, "max_tokens": 4},
    {"text_input": "a", "max_tokens": 4, "stop_words": ["x"] * 100_000},
    {"text_input": "a", "max_tokens": 4, "bad_words": ["x" * 100_000]},
    {"text_input": "a", "max_tokens": 4, "top_k": 2**31 - 1, "beam_width": 4},
    {"text_input": ["a", "b"], "max_tokens": [1, 2]},
])
def test_triton_generate_refuses_hostile_bodies_with_4xx(server, rss_before, body):
    _refused_cleanly(_post(f"{server.http}/v2/models/ensemble/generate",
                           json.dumps(body).encode()))


def _grpc_error(grpc: str, model: str, arrays: dict[str, np.ndarray]) -> str:
    """The error message ``model`` answers ``arrays`` with over gRPC (a stream: the ensemble
    and orchestrator are decoupled), within ``ANSWER_SECONDS``: one line, no traceback."""
    import queue

    import tritonclient.grpc as grpcclient

    from triton_disagg.clients.stream import array_inputs

    answers: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(grpc) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer(model, array_inputs(arrays))
            _, error = answers.get(timeout=ANSWER_SECONDS)
        finally:
            client.stop_stream(cancel_requests=True)
    assert error is not None, "a hostile request was served"
    message = error.message()
    assert message and "\n" not in message and "Traceback" not in message, message
    return message


def _i32(*values) -> np.ndarray:
    return np.array([list(values)], np.int32)


@pytest.mark.parametrize("arrays", [
    {"text_input": np.array([[b"\xff\xfe"]], object), "max_tokens": _i32(4)},
    {"text_input": np.array([[1.5]], np.float32), "max_tokens": _i32(4)},
    {"text_input": np.array([[b"a"]], object), "max_tokens": _i32(-1)},
    {"text_input": np.array([[b"a"]], object), "max_tokens": _i32(2**31 - 1)},
    {"text_input": np.array([[b"a"]], object), "max_tokens": _i32(4),
     "stop_words": np.array([[b"x"] * 50_000], object)},
    {"text_input": np.array([[b"a"]], object), "max_tokens": _i32(4),
     "end_id": _i32(2**31 - 1), "top_k": _i32(-7)},
])
def test_grpc_ensemble_refuses_hostile_tensors(server, rss_before, arrays):
    _grpc_error(server.grpc, "ensemble", arrays)


@pytest.mark.parametrize("arrays", [
    {"input_ids": _i32(3, 4), "input_lengths": _i32(99), "request_output_len": _i32(4)},
    {"input_ids": _i32(-1, 2**31 - 1), "input_lengths": _i32(2), "request_output_len": _i32(4)},
    {"input_ids": _i32(3, 4), "input_lengths": _i32(2), "request_output_len": _i32(-4)},
    {"input_ids": _i32(3, 4), "input_lengths": _i32(2), "request_output_len": _i32(4),
     "stop_words_list": np.zeros((1, 2, 64), np.int32) - 5},
])
def test_orchestrator_called_directly_answers_an_error(server, rss_before, arrays):
    """Refused (no peer credential) or rejected, the orchestrator answers a clean error."""
    _grpc_error(server.grpc, "orchestrator", arrays)


# ---- a burst past the request cap --------------------------------------------------------

def test_a_burst_past_the_cap_gets_429_with_retry_after(server, rss_before):
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 64, "ignore_eos": True,
            "stream": True}

    def one(_):
        with requests.post(f"{server.front}/v1/completions", json=body, stream=True,
                           timeout=60) as resp:
            return resp.status_code, resp.headers.get("Retry-After"), resp.text
    with ThreadPoolExecutor(4 * CAP) as pool:
        answers = list(pool.map(one, range(4 * CAP)))
    refused = [a for a in answers if a[0] == 429]
    served_ = [a for a in answers if a[0] == 200]
    assert len(refused) + len(served_) == len(answers), [a[0] for a in answers]
    assert refused and len(served_) >= 1, [a[0] for a in answers]
    assert all(a[1] == "1" and "max_concurrent_requests" in a[2] for a in refused)
    assert all(a[2].rstrip().endswith("data: [DONE]") for a in served_)


# ---- afterwards ---------------------------------------------------------------------------

def test_after_the_fuzz_it_serves_holds_no_blocks_and_grew_bounded(server, rss_before):
    resp = requests.post(f"{server.front}/v1/completions", timeout=60,
                         json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"], resp.text
    status, body = servers.generate(server.http, {"text_input": PROMPTS[1], "max_tokens": 4})
    assert status == 200 and body["text_output"], body
    servers.wait_until(lambda: total(scrape(server.metrics), "disagg_kv_blocks_used") == 0,
                       30, "KV blocks back to 0", poll=0.2)
    after = _rss(server.work_dir)
    grown = {pid: after[pid] - rss for pid, rss in rss_before.items() if pid in after}
    assert set(grown) == set(rss_before), "a process of the server died during the fuzz"
    assert max(grown.values()) < RSS_GROWTH_BOUND, {p: g // MiB for p, g in grown.items()}

"""The HTTP front of a real `serve all` (the demo engine) driven by schemathesis from its own
OpenAPI document (``GET /openapi.json``, built from the request models): requests that fit
the document (positive; the served model's, a few tokens each: :func:`served`) and requests
that break it (negative), for every operation, derandomized and bounded (``EXAMPLES`` per
operation and mode). Every answer is below 500, every error body is OpenAI's error object as
the document's ``Error`` schema says, and afterwards the server still answers and holds no
KV block. One server for the module (tests/server/conftest.py)."""

from __future__ import annotations

import jsonschema
import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings

import servers
from front_server import MODEL, blocks_used

EXAMPLES = 40                   # per operation and mode: ~1 minute in all, 2-core machine
ANSWER_SECONDS = 60             # one generated request, on a busy machine
MAX_TOKENS = 8                  # of a generated request that fits the document


def served(body: dict) -> None:
    """A body that fits the document, made to generate a few tokens of the served model
    (else most are 404 for a random model name, and a chat generates the whole context)."""
    if "model" in body or "messages" in body:
        body["model"] = MODEL
    for name in ("max_tokens", "max_completion_tokens"):
        if name == "max_tokens" or name in body:
            body[name] = min(body.get(name) or MAX_TOKENS, MAX_TOKENS)


@pytest.fixture(scope="module")
def document(server) -> dict:
    resp = requests.get(f"{server.front}/openapi.json", timeout=10)
    assert resp.status_code == 200
    return resp.json()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_generated_requests_get_no_5xx_and_openai_errors(server, document, mode):
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{server.front}/openapi.json")
    error_schema = {"$ref": "#/components/schemas/Error", "components": document["components"]}
    session, seen = requests.Session(), {}

    @settings(max_examples=EXAMPLES * len(document["paths"]), deadline=None,
              derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=schema.as_strategy(generation_mode=GenerationMode(mode)))
    def answer(case) -> None:
        if mode == "positive" and isinstance(case.body, dict):
            served(case.body)
        response = case.call(base_url=server.front, session=session, timeout=ANSWER_SECONDS)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            request_id = response.headers.get("X-Request-Id", "")
            raise AssertionError(f"{case.method} {case.path} {case.body!r:.300} -> "
                                 f"{response.text[:300]}\n{server.why(request_id)}")
        if response.status_code >= 400:
            jsonschema.validate(response.json(), error_schema)

    answer()
    print(f"{mode}: status -> count {sorted(seen.items())}")
    if mode == "positive":
        assert seen.get(200, 0) >= EXAMPLES and any(status >= 400 for status in seen), seen
    else:
        assert min(seen) >= 400, seen
    ok = requests.post(f"{server.front}/v1/completions", timeout=ANSWER_SECONDS,
                       json={"model": MODEL, "prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    servers.wait_until(lambda: blocks_used(server) == 0, 30, "KV blocks back to 0", poll=0.1)

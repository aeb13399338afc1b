"""Fixtures of the HTTP front's and the doors' server tests (test_http_front.py,
test_openai_extensions.py, test_openapi_fuzz.py, test_top_logprobs_sdk.py,
test_served_grpc_door.py, test_served_http_doors.py; test_generation_prefix_reuse.py brings
its own ``server``): one real ``serve all`` (disaggregated, the demo engine) per test
module, and what they call it with: the official ``openai`` SDK, the offline engine's greedy
text, the engine's tokenizer. A module that defines a fixture of the same name uses its own."""

from __future__ import annotations

import pytest

import servers
from front_server import MODEL


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
def tokenizer(demo_engine):
    from triton_disagg.front.tokenizer import Tokenizer

    return Tokenizer(demo_engine)

"""`serve all` in aggregated mode on the demo engine: a real tritonserver, real clients.

Greedy text over HTTP generate, HTTP generate_stream and tritonclient gRPC
streaming equals the engine's offline output; per-request errors leave the
server serving. This server streams with ``stream_interval: 2`` (two tokens per
response after the first), so its streaming tests also prove grouped deltas stay
exact; the disaggregated tests stream one token per response.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import servers

from servers import PROMPTS
from triton_disagg.routing.scrape import delta, scrape, total


@pytest.fixture(scope="module")
def offline(demo_engine):
    return servers.offline_text(demo_engine)


@pytest.fixture(scope="module")
def server(demo_engine, tmp_path_factory):
    with servers.serve_config(
            f"model: {{engine: {demo_engine}}}\nmode: aggregated\n"
            f"generation_server: {{instances: 1, stream_interval: 2}}\nkv_cache: {{max_size: 64MB}}\n",
            tmp_path_factory.mktemp("serve-aggregated")) as served:
        yield served


@pytest.mark.parametrize("prompt", PROMPTS)
def test_http_generate_equals_offline(server, offline, prompt):
    status, body = servers.generate(server.http, {"text_input": prompt, "max_tokens": 24})
    assert status == 200, body
    assert body["text_output"] == offline(prompt, 24)
    assert body["num_output_tokens"] <= 24


@pytest.mark.parametrize("prompt", PROMPTS)
def test_generate_stream_deltas_concatenate_to_generate(server, offline, prompt):
    events = servers.generate_stream(server.http, {"text_input": prompt, "max_tokens": 24,
                                                   "stream": True})
    assert all("error" not in e for e in events), events
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == offline(prompt, 24)
    # The first token alone, then pairs: at most 1 + 23 / 2 responses carry text.
    assert len([e for e in events if e["text_output"]]) <= 13


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_grpc_streaming_equals_offline(server, offline, prompt):
    deltas = servers.grpc_stream(server.grpc, prompt, 24)
    assert len(deltas) > 1 and "".join(deltas) == offline(prompt, 24)
    (whole,) = servers.grpc_stream(server.grpc, prompt, 24, stream=False)
    assert whole == offline(prompt, 24)


def test_concurrent_requests_are_batched_and_each_correct(server, offline):
    jobs = [(p, 16 + i) for i, p in enumerate(PROMPTS * 2)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: servers.generate(
            server.http, {"text_input": j[0], "max_tokens": j[1]}), jobs))
    for (prompt, n), (status, body) in zip(jobs, results):
        assert status == 200 and body["text_output"] == offline(prompt, n)


def test_a_shared_prefix_is_served_from_the_cache_with_the_uncached_text(server, offline):
    """Prompts sharing a long prefix, over HTTP and gRPC: the later ones
    hit the generation instance's prefix cache (its counters say so, with the blocks it
    keeps) and every text is the one computed without the cache."""
    prefix = "A long system prompt that every turn of the conversation repeats. " * 6
    before = scrape(server.metrics)
    for i, suffix in enumerate(["Who are you?", "What is 2 + 2?", "Tell me a story."]):
        status, body = servers.generate(server.http, {"text_input": prefix + suffix,
                                                      "max_tokens": 12})
        assert status == 200 and body["text_output"] == offline(prefix + suffix, 12), body
    assert "".join(servers.grpc_stream(server.grpc, prefix + "Bye.", 12)) == \
        offline(prefix + "Bye.", 12)

    def hits() -> float:
        return delta(before, scrape(server.metrics), "disagg_prefix_cache_hits_total",
                     role="generation")
    servers.wait_until(lambda: hits() >= 3 * 32, 10, "the cache's hits counted", poll=0.1)
    after = scrape(server.metrics)
    assert delta(before, after, "disagg_prefix_cache_queries_total", role="generation") > hits()
    assert total(after, "disagg_kv_blocks_cached", role="generation") >= 2
    servers.wait_until(lambda: total(scrape(server.metrics), "disagg_kv_blocks_used") == 0,
                       10, "no block held at rest", poll=0.1)


def test_outputs_and_options(server, offline):
    status, body = servers.generate(server.http, {
        "text_input": "The quick brown fox", "max_tokens": 5, "return_log_probs": True,
        "exclude_input_in_output": False})
    assert status == 200, body
    assert body["text_output"].startswith("The quick brown fox")
    assert body["num_input_tokens"] == 5 and body["num_output_tokens"] == 5     # BOS + 4
    assert len(body["output_log_probs"]) == 5 and all(lp <= 0 for lp in body["output_log_probs"])
    assert body["cum_log_probs"] == pytest.approx(sum(body["output_log_probs"]), rel=1e-5)
    status, body = servers.generate(server.http, {"text_input": "The quick brown fox",
                                                  "max_tokens": 5})
    assert status == 200 and body["num_output_tokens"] == 5      # log probs only when asked
    assert "output_log_probs" not in body and "cum_log_probs" not in body


@pytest.mark.parametrize("payload, words", [
    ({"max_tokens": 4}, ["text_input is missing"]),
    ({}, ["request has 0 inputs"]),                  # Triton refuses it itself
    ({"text_input": "hi"}, ["max_tokens is required"]),
    ({"text_input": "hi", "stream": False}, ["max_tokens is required"]),   # a second input
    ({"text_input": "hi", "max_tokens": 0}, ["max_tokens", ">= 1"]),
    ({"text_input": "hi", "max_tokens": 4, "beam_width": 2}, ["beam_width", "not supported"]),
    ({"text_input": "x " * 3000, "max_tokens": 4}, ["prompt", "max_seq_len"]),
    ({"text_input": "hi", "max_tokens": 4, "top_p": 5.0}, ["top_p"]),
    ({"text_input": "hi", "max_tokens": 4, "lora_task_id": 3}, ["LoRA"]),
])
def test_per_request_errors_keep_the_server_serving(server, offline, payload, words):
    status, body = servers.generate(server.http, payload)
    assert status == 400, body
    for word in words:
        assert word in body["error"], body
    status, body = servers.generate(server.http, {"text_input": "a", "max_tokens": 3})
    assert status == 200 and body["text_output"] == offline("a", 3)


def test_missing_max_tokens_over_a_grpc_stream_is_refused(server):
    """Beside another input (stream), Triton 2.51 itself lets the request through."""
    with pytest.raises(RuntimeError, match="max_tokens is required"):
        servers.grpc_stream(server.grpc, "hi", 4, extra={"max_tokens": None})
    assert servers.generate(server.http, {"text_input": "a", "max_tokens": 2})[0] == 200


def test_wrong_dtype_over_grpc_is_refused(server):
    with pytest.raises(RuntimeError, match="max_tokens"):
        servers.grpc_stream(server.grpc, "hi", 4, extra={
            "max_tokens": np.array([[4.0]], dtype=np.float32)})
    assert servers.generate(server.http, {"text_input": "a", "max_tokens": 2})[0] == 200


def test_cancel_reaches_the_generation_instance_holding_the_request(demo_engine, tmp_path):
    """With two generation instances, Triton hands the orchestrator's stop to either one;
    every cancel must still end its request (the instances share posted stops)."""
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\nmode: aggregated\n"
                      f"generation_server: {{cpus: [0, 1], instances: 2}}\n"
                      f"kv_cache: {{max_size: 64MB}}\n")
    cancels = 4
    with servers.serve("all", ["-c", str(config)], tmp_path / "run") as served:
        for _ in range(cancels):
            servers.cancel_a_stream(served.grpc, served.metrics)
        deadline = time.monotonic() + 30
        while True:
            text = servers.metrics(served.metrics)
            counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("disagg_requests_total") and 'role="generation"' in line
                      and 'outcome="cancelled"' in line]
            if sum(counts) == cancels or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert sum(counts) == cancels, text

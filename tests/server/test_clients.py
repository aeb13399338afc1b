"""clients/: request building, timing, workloads, and the client CLI and examples against
a real `serve all` (default config: disaggregated)."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import servers
from triton_disagg.clients import cli
from triton_disagg.clients.stream import (GenerateError, GenerateRequest, Measurement,
                                          _error_text, parse_event, sse_events)
from triton_disagg.clients.workload import Lengths, make_prompt
from triton_disagg.errors import UserError

EXAMPLES = Path(__file__).resolve().parents[2] / "clients" / "examples"


def client(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["client", *argv])
    return args.func(args)


def test_request_tensors_match_the_ensemble_interface():
    r = GenerateRequest("héllo", 8, True, {"temperature": 0.5, "seed": 3, "stop_words": ["a b"]})
    t = r.tensors()
    assert t["text_input"].shape == (1, 1) and t["text_input"][0, 0] == "héllo".encode()
    assert t["max_tokens"].dtype == np.int32 and t["seed"].dtype == np.uint64
    assert t["temperature"].dtype == np.float32 and t["stream"].dtype == np.bool_
    assert t["stop_words"].shape == (1, 1) and t["return_num_output_tokens"][0, 0]
    assert r.json() == {"text_input": "héllo", "max_tokens": 8, "stream": True,
                        "return_num_input_tokens": True, "return_num_output_tokens": True,
                        "temperature": 0.5, "seed": 3, "stop_words": ["a b"]}
    with pytest.raises(ValueError, match="not an input"):
        GenerateRequest("x", 1, options={"beam": 2})


def test_measurement_ttft_tpot_itl():
    m = Measurement(start=10.0)
    for at, n in ((10.1, 1), (10.15, 2), (10.3, 4)):
        m.on_response("x", 5, n, at=at)
    m.end = 10.3
    assert m.ttft == pytest.approx(0.1) and m.output_tokens == 4
    assert m.tpot == pytest.approx(0.2 / 3)
    assert m.itl == pytest.approx([0.05, 0.15, 0.0])      # the last response carried 2 tokens
    one = Measurement(start=0.0)
    one.on_response("whole", 3, 9, at=0.5)
    assert one.ttft == 0.5 and one.tpot is None and one.itl == []


def test_sse_and_error_parsing():
    lines = [b'data: {"text_output": "a", "num_output_tokens": 1}', b"", b"data: {\"text_output\": \"b\"}"]
    assert [parse_event(e)[0] for e in sse_events(lines)] == ["a", "b"]
    with pytest.raises(GenerateError, match="boom"):
        parse_event({"error": "boom"})
    assert _error_text('data: {"error":"too long"}\n\n') == "too long"
    assert _error_text("plain") == "plain"


def test_lengths_and_prompts(demo_engine):
    from triton_disagg.front.tokenizer import Tokenizer

    rng = random.Random(0)
    for spec in ("7", "fixed:7", "uniform:3,9", "normal:20,50", "lognormal:16,1.5"):
        values = [Lengths.parse(spec, max=64).sample(rng) for _ in range(200)]
        assert 1 <= min(values) and max(values) <= 64
    assert Lengths.parse("uniform:3,9").sample(rng) in range(3, 10)
    for bad in ("uniform:3", "gauss:1,2", "x", "normal:-1,2"):
        with pytest.raises(UserError, match="length distribution"):
            Lengths.parse(bad)
    tokenizer = Tokenizer(demo_engine)
    for n in (4, 32, 100):
        assert n - 3 <= len(tokenizer.encode(make_prompt(n, rng, tokenizer))) <= n
    assert len(make_prompt(12, rng).split()) == 12


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_unreachable_server_is_one_clear_error(protocol):
    (port,) = servers.free_ports(1)
    with pytest.raises(UserError, match="no Triton server answers"):
        client("hi", "--protocol", protocol, "--url", f"127.0.0.1:{port}")


@pytest.fixture(scope="module")
def served(demo_engine, tmp_path_factory):
    with servers.serve("all", ["--engine", str(demo_engine)], tmp_path_factory.mktemp("clients")) as s:
        yield s


def test_client_grpc_and_http_agree(served, capsys):
    runs = {}
    for protocol, url in (("grpc", served.grpc), ("http", served.http)):
        for stream in (True, False):
            argv = ["The quick brown fox", "--protocol", protocol, "--url", url,
                    "--max-tokens", "12", "--end-id", "-1", "--json"]
            assert client(*argv, *([] if stream else ["--no-stream"])) == 0
            runs[protocol, stream] = json.loads(capsys.readouterr().out)
    texts = {r["text"] for r in runs.values()}
    assert len(texts) == 1 and texts.pop()                  # greedy: one text everywhere
    for (protocol, stream), r in runs.items():
        assert r["protocol"] == protocol and r["stream"] == stream
        assert r["num_output_tokens"] == 12 and r["num_input_tokens"] > 0
        assert r["ttft_ms"] > 0 and r["e2e_ms"] >= r["ttft_ms"]
        assert (r["time_per_output_token_ms"] is not None) == stream
        # streaming: tokens that were ready together may share a response
        assert 2 <= r["responses"] <= 12 if stream else r["responses"] == 1


def test_client_prints_text_then_timings(served, capsys):
    assert client("Hello", "--url", served.grpc, "--max-tokens", "6", "--temperature", "0.8",
                  "--top-k", "20", "--seed", "5", "--stop-words", "zz") == 0
    out, err = capsys.readouterr()
    assert out.strip() and "TTFT" in err and "time per output token" in err


def test_client_reports_the_servers_refusal(served):
    for protocol, url in (("grpc", served.grpc), ("http", served.http)):
        with pytest.raises(UserError, match="refused the request: .*max_seq_len"):
            client("Hello", "--protocol", protocol, "--url", url, "--max-tokens", "100000")


@pytest.mark.parametrize("script, url", [("grpc_streaming.py", "grpc"),
                                         ("http_tritonclient.py", "http_hostport"),
                                         ("http_requests.py", "http"),
                                         ("openai_chat.py", "front")])
def test_examples_run(served, script, url):
    urls = {"grpc": served.grpc, "http": served.http, "front": served.front,
            "http_hostport": served.http.removeprefix("http://")}
    done = subprocess.run([sys.executable, str(EXAMPLES / script), "The quick brown fox",
                           "--url", urls[url], "--max-tokens", "8"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()

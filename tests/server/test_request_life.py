"""docs/architecture.md's "One request, file by file" table is the request's life as it
really is: `serve all` (disaggregated, the default config) runs with every Python process
traced (tests/support/request_trace.py), one streamed request goes through each public path
(the OpenAI front's SSE ``/v1/completions``; a tritonclient gRPC stream to the ensemble),
and the files of ours in which it ran code (less what the processes run while idle) must
be the table's rows for that path (tests/support/life_table.py), no more and no fewer.
The counts are printed (30 OpenAI, 30 ensemble when this was written) and kept in the doc's
prose, which tests/unit/test_life_table.py checks against the table and against issue 28's
bound of 30 files a path."""

from __future__ import annotations

import json

import pytest
import requests

import life_table
import request_trace
import servers
from life_table import PATHS
from request_trace import Tracer, crossed_files

MAX_TOKENS = 8
IDLE_SECONDS = 3.0             # longer than the servers' sub-second background loops


@pytest.fixture(scope="module")
def traced(demo_engine, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve-traced")
    config = work / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\n")
    env = request_trace.traced_env(work / "trace", work / "run")
    with request_trace.hooked_site(), \
            servers.serve("all", ["-c", str(config)], work / "run", env=env) as served:
        yield served, Tracer(work / "trace"), demo_engine.name


def _openai_stream(served, model: str, prompt: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True,
            "temperature": 0}
    with requests.post(f"{served.front}/v1/completions", json=body, stream=True,
                       timeout=120) as resp:
        assert resp.status_code == 200, resp.text
        lines = [line for line in resp.iter_lines() if line.startswith(b"data:")]
    assert lines[-1] == b"data: [DONE]" and len(lines) > 2, lines


def _grpc_stream(served, model: str, prompt: str) -> None:
    assert len(servers.grpc_stream(served.grpc, prompt, MAX_TOKENS)) > 1


SENDERS = {"OpenAI": _openai_stream, "ensemble": _grpc_stream}


def _pools_free(served) -> None:
    """Wait for the request's blocks to be freed, read from tritonserver's own metrics (the
    metrics door's code, which a scrape of the public port runs, is the test's, not the
    request's)."""
    from triton_disagg.routing.scrape import scrape, total

    inner = f"http://127.0.0.1:{servers.tritonserver_flag(served.work_dir, 'metrics-port')}"
    servers.wait_until(lambda: total(scrape(inner), "disagg_kv_blocks_used") == 0,
                       30, "the request's KV blocks freed")


@pytest.fixture(scope="module")
def crossed(traced) -> dict[str, set[str]]:
    """path -> the files one streamed request through it ran code in. Each path is warmed
    first (lazy imports, first-call set-up), then traced on another prompt (no prefix hit)."""
    served, tracer, model = traced
    found = {}
    for path, send in SENDERS.items():
        send(served, model, f"warm up the {path} path")
        _pools_free(served)
        found[path] = crossed_files(tracer, lambda: send(served, model, f"the {path} request"),
                                    lambda: _pools_free(served), IDLE_SECONDS)
    print(json.dumps({path: sorted(files) for path, files in found.items()}, indent=1))
    return found


@pytest.mark.parametrize("path", PATHS)
def test_the_table_lists_the_files_a_streamed_request_crosses(crossed, path):
    listed = life_table.files_by_path()[path]
    missing, extra = sorted(crossed[path] - listed), sorted(listed - crossed[path])
    assert not missing and not extra, (
        f"docs/architecture.md's table is not the {path} request's life:\n"
        f"rows to add: {missing}\nrows to remove (or mark for the other path): {extra}")

"""The HTTP front against bodies that are cheap to send and dear to check
(triton_disagg/front/openai_models.py, openai_api.py), its relay scripted
(tests/support/scripted_relay.py): millions of chat content parts are refused at the list's
length, in well under a second and without GiBs of memory, thousands of unknown fields are
one error, and a large body's check runs off the event loop, so ``/healthz`` is answered
meanwhile."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
from pydantic import ValidationError

import scripted_relay
import triton_disagg.front.generation_routes as generation_routes
from scripted_relay import WORDS, ScriptedRelay, run
from triton_disagg.front.openai_api import OFF_LOOP_BYTES
from triton_disagg.front.openai_models import MAX_TEXT_PARTS, MAX_TEXT_PARTS_TOTAL, ChatRequest

# One chat body of ``parts`` content parts (2,000,000: 5.7 MiB) sent to a front in a fresh
# process, so its peak RSS is its own; prints the answer, the seconds and the RSS growth.
_ONE_HEAVY_BODY = """
import asyncio, json, resource, sys, time
from aiohttp.test_utils import TestClient, TestServer
from scripted_relay import ScriptedRelay
from triton_disagg.config.front_section import FrontConfig
from triton_disagg.front.http_front import make_app
from triton_disagg.front.orchestrator_call import RequestEncoder

async def main(engine, parts):
    body = json.dumps({"model": "demo",
                       "messages": [{"role": "user", "content": [1] * parts}]}).encode()
    app = make_app(RequestEncoder(engine, "demo"), ScriptedRelay([]), FrontConfig(), "127.0.0.1")
    async with TestClient(TestServer(app)) as client:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        answer = await client.post("/v1/chat/completions", data=body)
        error = (await answer.json())["error"]
        seconds = time.perf_counter() - start
        grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    print(json.dumps({"mib": len(body) / 2**20, "status": answer.status,
                      "message": error["message"], "seconds": seconds, "grown_mib": grown_mib}))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def test_millions_of_content_parts_are_refused_at_once_and_small(demo_engine):
    support = os.path.dirname(scripted_relay.__file__)
    run = subprocess.run([sys.executable, "-c", _ONE_HEAVY_BODY, str(demo_engine), "2000000"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": support})
    assert run.returncode == 0, run.stderr[-2000:]
    seen = json.loads(run.stdout.splitlines()[-1])
    assert seen["mib"] > 5.5 and seen["status"] == 400, seen
    # refused by the body's count of JSON values, before it is parsed (openai_api's
    # BodyBounds; a body within it reaches the list's length check: the test below)
    assert seen["message"].startswith("the body's JSON has 2000006 values") and \
        "more than" in seen["message"], seen
    # before: 14 s and 3.3 GiB (the 2M parts validated, 2M errors built); the JSON parse
    # after: 0.15 s and 21 MiB; counted, not parsed (rev27k M3): 0.04 s (a loaded 2-core
    # machine)
    assert seen["seconds"] < 1.0 and seen["grown_mib"] < 200, seen


def _chat(parts_per_message: list[int]) -> dict:
    return {"model": "demo", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}] * n}
        for n in parts_per_message]}


def test_content_parts_are_bounded_per_message_and_in_all(demo_engine):
    per_message = [MAX_TEXT_PARTS] * (MAX_TEXT_PARTS_TOTAL // MAX_TEXT_PARTS)

    async def check(client):
        cases = [(_chat([MAX_TEXT_PARTS + 1]), "'messages[0].content': 257 items; at most 256"),
                 (_chat([*per_message, 1]), f"'messages': more than {MAX_TEXT_PARTS_TOTAL} "
                                            f"content parts in all messages"),
                 (_chat([2, 1]), None)]
        for body, refusal in cases:
            answer = await client.post("/v1/chat/completions", json=body)
            if refusal is None:
                assert answer.status == 200, await answer.text()
            else:
                assert answer.status == 400 and \
                    (await answer.json())["error"]["message"] == refusal

    run(ScriptedRelay(WORDS), check, demo_engine)


def test_unknown_fields_are_one_error_not_one_each():
    body = {**_chat([1]), **{f"field{i}": 1 for i in range(1000)}, "nothing": None}
    with pytest.raises(ValidationError) as err:
        ChatRequest.model_validate(body)
    assert err.value.error_count() == 1 and err.value.errors()[0]["loc"] == ("field0",)


def test_a_large_body_is_checked_off_the_event_loop(demo_engine, monkeypatch):
    checking, checks_began = 1.5, []        # s a large body's check is made to take

    def slow_parse(*args, **kwargs):
        checks_began.append(time.perf_counter())
        time.sleep(checking)
        return parse(*args, **kwargs)
    parse = generation_routes.parse
    monkeypatch.setattr(generation_routes, "parse", slow_parse)
    large = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
             "user": "u" * OFF_LOOP_BYTES, "max_tokens": 3}     # large, yet a short prompt

    async def check(client):
        start = time.perf_counter()
        heavy = asyncio.ensure_future(client.post("/v1/chat/completions", json=large))
        await asyncio.sleep(0.3)                # the body sent, its check begun
        health = await client.get("/healthz")
        waited = time.perf_counter() - start
        assert checks_began and checks_began[0] - start < 0.3, checks_began
        # before: the loop blocked for the check's 1.5 s
        assert health.status == 200 and waited < 0.3 + 0.5, waited
        assert (await heavy).status == 200

    run(ScriptedRelay(WORDS), check, demo_engine)

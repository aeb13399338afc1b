"""The HTTP door's bounds on what reaches tritonserver (issue 27, HTTP side of the gRPC
door's): a body whose JSON has too many strings or values, or an inference request naming
a model not served, is refused (400) before it is forwarded; bodies forwarded and not yet
answered hold at most the door's byte budget, and one past it waits. The inner
tritonserver is an in-process aiohttp stand-in that records what reaches it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time

import aiohttp
from aiohttp import ClientSession, web
from local_sites import free_port, serve_locally
from yarl import URL

from triton_disagg.front.http_door import BUDGET, json_size, make_http_door
from triton_disagg.front.door_guards import MAX_ENTRIES, ByteBudget, InnerOwner

MAX_BYTES = 10 * 2**20


@contextlib.asynccontextmanager
async def _door(answer: asyncio.Event | None = None, reply: bytes = b"ok", **kwargs):
    """(the door's URL, its app, the bodies tritonserver's stand-in received): the stand-in
    answers each request ``reply`` once ``answer`` is set (at once without one)."""
    received: list[bytes] = []

    async def inner(request: web.Request) -> web.Response:
        received.append(await request.read())
        if answer is not None:
            await answer.wait()
        return web.Response(body=reply)

    inner_app = web.Application(client_max_size=MAX_BYTES)
    inner_app.router.add_route("*", "/{path:.*}", inner)
    inner_runner, inner_port = await serve_locally(inner_app)
    body_timeout = kwargs.pop("body_timeout", 5.0)
    app = make_http_door(f"127.0.0.1:{inner_port}", MAX_BYTES, 8, body_timeout, **kwargs)
    runner, port = await serve_locally(app)
    try:
        yield f"http://127.0.0.1:{port}", app, received
    finally:
        await runner.cleanup()
        await inner_runner.cleanup()


def _holds(budget: ByteBudget) -> int:
    """The bytes ``budget`` holds, of its pool and its requests' reserves."""
    return budget.held + budget.reserved


async def _emptied(budget: ByteBudget, seconds: float = 5) -> int:
    """Wait up to ``seconds`` for ``budget`` to hold nothing (the door gives a body's bytes
    back just after its answer's last byte is written); what it holds then."""
    deadline = time.monotonic() + seconds
    while _holds(budget) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return _holds(budget)


def _infer_body(strings: int) -> bytes:
    """Triton's JSON infer body with one BYTES input of ``strings`` empty strings."""
    return json.dumps({"inputs": [{"name": "stop_words", "datatype": "BYTES",
                                   "shape": [1, strings], "data": [""] * strings}]}).encode()


def test_json_size_counts_strings_exactly_and_bounds_values():
    text = rb'{"a": ["", "x\\", "\"q", "\\\"", 1, -2.5e3, null, {}, [], "[{,,}]"]}'
    assert len(json.loads(text)["a"]) == 10
    assert json_size(text, 10) == (6, 1 + 9 + 2 + 2)   # strings: "a" and 5; values: <= 1 + 10
    assert json_size(text, 5) == (6, 0)                # past max_strings: values not counted
    assert json_size(_infer_body(1000), MAX_ENTRIES)[0] == 1000 + 7   # 5 keys, name, datatype
    assert json_size(b"[" + b"0," * 999 + b"0]", MAX_ENTRIES) == (0, 1001)
    assert json_size(b'["' + b"a, " * 10**5 + b'"]', MAX_ENTRIES) == (1, 2)   # prose's commas


def test_a_body_of_too_many_strings_or_values_is_refused_before_tritonserver():
    """A 9 MB body of 3 million "" took tritonserver +100 MB, one of 4M numbers 136 MB
    (rapidjson's objects); the door counts them from the bytes first."""
    async def main():
        async with _door() as (url, _, received):
            async with ClientSession() as session:
                async with session.post(f"{url}/v2/models/m/infer",
                                        data=_infer_body(64)) as small:
                    assert small.status == 200 and len(received) == 1
                async with session.post(f"{url}/v2/models/m/infer",
                                        data=_infer_body(MAX_ENTRIES + 1)) as many:
                    assert many.status == 400
                    assert f"at most {MAX_ENTRIES}" in (await many.json())["error"]
                numbers = b'{"input_ids": [' + b"0," * MAX_ENTRIES + b"0]}"   # objects too
                async with session.post(f"{url}/v2/models/m/versions/2/generate_stream",
                                        data=numbers) as packed:
                    assert packed.status == 400
                    assert f"{MAX_ENTRIES + 3} values" in (await packed.json())["error"]
                async with session.post(f"{url}/v2/trace/setting",
                                        data=_infer_body(MAX_ENTRIES + 1)) as other:
                    assert other.status == 400        # any body is JSON to Triton
                assert len(received) == 1
    asyncio.run(main())


def test_binary_tensors_are_not_counted_but_their_json_header_is():
    async def main():
        async with _door() as (url, _, received):
            header = _infer_body(2)
            raw = b'"",' * (MAX_ENTRIES + 1)          # binary data: never parsed as JSON
            async with ClientSession() as session:
                for length, status in ((len(header), 200), (len(header) + len(raw), 400),
                                       ("12abc", 400), (len(header) + len(raw) + 1, 400)):
                    async with session.post(
                            f"{url}/v2/models/m/infer", data=header + raw,
                            headers={"Inference-Header-Content-Length": str(length)}) as r:
                        assert r.status == status, (length, await r.text())
                async with session.post(    # generate has no binary part: all of it is JSON
                        f"{url}/v2/models/m/generate", data=header + raw,
                        headers={"Inference-Header-Content-Length": str(len(header))}) as r:
                    assert r.status == 400
            assert received == [header + raw]
    asyncio.run(main())


def test_an_inference_request_naming_a_model_not_served_is_refused():
    async def main():
        async with _door(models=frozenset({"ensemble"})) as (url, _, received):
            async with ClientSession() as session:
                for path, status in (("/v2/models/ensemble/versions/1/infer", 200),
                                     ("/v2/models/nosuch/generate", 400),
                                     ("/v2/models/ensembl%65/infer", 400),   # Triton's view
                                     ("/v2/models/nosuch/config", 200)):     # not inference
                    async with session.post(URL(f"{url}{path}", encoded=True),
                                            data=b"{}") as r:
                        assert r.status == status, (path, await r.text())
                        if status == 400:
                            assert "is not served here" in (await r.json())["error"]
            assert len(received) == 2
    asyncio.run(main())


def test_unanswered_bodies_hold_at_most_the_budget_a_body_past_it_waits():
    """Many 10 MB bodies at once multiplied tritonserver's memory; a body past the budget
    waits until an answer has been relayed (up to the body timeout: then 503)."""
    async def main():
        answer = asyncio.Event()
        body = _infer_body(1000)
        budget = ByteBudget(int(2.5 * len(body)))
        async with _door(answer, budget=budget) as (url, app, received):
            assert app[BUDGET] is budget
            async with ClientSession() as session:
                posts = [asyncio.create_task(session.post(f"{url}/v2/models/m/infer",
                                                          data=body)) for _ in range(3)]
                deadline = time.monotonic() + 5
                while len(received) < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)
                assert len(received) == 2 and budget.held == 2 * len(body)
                answer.set()
                for post in posts:
                    async with await post as r:
                        assert r.status == 200
                assert len(received) == 3 and await _emptied(budget) == 0
    asyncio.run(main())


def test_the_budget_is_given_back_on_every_path():
    """A waiter past the body timeout (503), a client that leaves, tritonserver gone (502)."""
    async def main():
        answer = asyncio.Event()
        body = _infer_body(1000)
        budget = ByteBudget(len(body))
        async with _door(answer, budget=budget, body_timeout=0.5) as (url, app, received):
            async with ClientSession() as session:
                held = asyncio.create_task(session.post(f"{url}/v2/models/m/infer", data=body))
                while not received:
                    await asyncio.sleep(0.05)
                async with session.post(f"{url}/v2/models/m/infer", data=body) as waited:
                    assert waited.status == 503 and waited.headers["Retry-After"] == "1"
                    assert f"over {len(body)} bytes" in (await waited.json())["error"]
                held.cancel()                         # the client leaves
            answer.set()
            assert await _emptied(budget) == 0 and len(received) == 1
        gone = make_http_door(f"127.0.0.1:{free_port()}", MAX_BYTES, 8, 5.0,
                              owner=InnerOwner(()), budget=budget)   # nobody listens there
        runner, port = await serve_locally(gone)
        try:
            async with ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{port}/v2/models/m/infer",
                                        data=body) as r:
                    assert r.status == 502
        finally:
            await runner.cleanup()
        assert budget.held == 0
    asyncio.run(main())


def test_a_client_that_reads_slowly_is_cut_and_gives_its_bytes_back():
    """rev27j H1: a client that read a large answer a few KiB at a time kept each write
    under aiohttp's stall drop and held its body's bytes of the shared budget until the
    whole answer was written (minutes). Each chunk must reach the client within
    ``answer_seconds`` of when it came from tritonserver, else the connection is cut (no
    normal end) and the bytes given back; a client that reads at once gets it whole."""
    async def main():
        reply = bytes(range(256)) * (32 * 2**20 // 256)          # 32 MiB
        async with _door(reply=reply, answer_seconds=1.0) as (url, app, _):
            async with ClientSession() as session:
                async with session.post(f"{url}/v2/models/m/infer", data=b"{}") as prompt:
                    whole = await prompt.read()
                assert hashlib.sha256(whole).digest() == hashlib.sha256(reply).digest()
            async with ClientSession(read_bufsize=4096) as session:
                begun, read = time.monotonic(), 0
                with contextlib.suppress(aiohttp.ClientPayloadError):
                    async with session.post(f"{url}/v2/models/m/infer", data=b"{}") as slow:
                        assert _holds(app[BUDGET]) > 0
                        while time.monotonic() - begun < 30 and (
                                chunk := await slow.content.read(4096)):
                            read += len(chunk)
                            await asyncio.sleep(0.05)         # ~80 KiB/s
                assert time.monotonic() - begun < 15 and read < len(reply)   # cut
            assert await _emptied(app[BUDGET]) == 0
    asyncio.run(main())

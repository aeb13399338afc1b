"""The public door's gates (issue 27 re-review rev27c), in process: an idle gRPC stream is
ended so idle clients cannot hold the call cap; health probes pass the HTTP door's request
cap and a refusal says when to retry; the HTTP door checks ``Origin`` as the front does; and
nothing is forwarded to an inner port with no listener of this user (:class:`InnerOwner`).
The inner tritonserver is an in-process stand-in (gRPC echo, aiohttp app)."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest
from aiohttp import ClientSession, web
from door_stand_in import STREAM, echoed, infer_request, open_door
from local_sites import free_port

from triton_disagg.config.front_section import FrontConfig
from triton_disagg.front.http_gates import add_origin_guard
from triton_disagg.front.http_door import CALLS, make_http_door
from triton_disagg.front.door_guards import MAX_ENTRIES, MAX_ID_CHARS, MAX_NUMBERS, InnerOwner
from triton_disagg.front.public_door import SERVICE


def test_an_idle_stream_is_ended_and_a_busy_one_is_not():
    async def main():
        async with open_door(idle_seconds=0.5) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                call = channel.stream_stream(STREAM)()
                begun = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    await call.read()                       # nothing sent, nothing back
                assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert time.monotonic() - begun < 5
                busy = channel.stream_stream(STREAM)()
                for i in range(6):                          # 1.2 s, a message every 0.2 s
                    message = infer_request(1, name=f"m{i}")
                    await busy.write(message)
                    assert await busy.read() == echoed(message)
                    await asyncio.sleep(0.2)
                await busy.done_writing()
    asyncio.run(main())


def test_a_unary_call_that_sends_nothing_is_ended_too():
    """rev27d: grpc.aio counts a unary call against the cap from its headers and its
    handler waited for the message without a deadline; every method is a stream now."""
    async def main():
        async with open_door(1, idle_seconds=0.5) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                held = channel.stream_stream(f"/{SERVICE}/ServerLive")()   # never writes
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    await held.read()
                assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    asyncio.run(main())


def test_inner_owner_needs_this_users_listener_on_127_0_0_1():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert InnerOwner((port,)).check()
        assert not InnerOwner((port, free_port())).check()  # one port with no listener
        with socket.socket(socket.AF_INET6) as aside:     # a v6-only wildcard beside it
            aside.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            aside.bind(("::", port))
            aside.listen()
            assert InnerOwner((port,)).check()             # takes none of 127.0.0.1's
    assert not InnerOwner((port,)).check()                 # closed: nobody's
    for elsewhere in ("127.0.0.2", "0.0.0.0"):
        with socket.socket() as aside:
            aside.bind((elsewhere, port))
            aside.listen()
            assert not InnerOwner((port,)).check(), elsewhere   # not the exact listener


def test_the_owner_check_reads_off_the_loop_once_for_every_caller(monkeypatch, tmp_path):
    """rev27k L3: the tables were parsed on the doors' event loop (49 ms for a host's 60,000
    sockets); now one read on a worker thread serves every caller waiting meanwhile, and a
    yes is then trusted without a read."""
    import threading

    import triton_disagg.front.door_guards as guards

    rows = "".join(f"   {i}: 0100007F:{i % 60000 + 1024:04X} 0100007F:1F90 01 00000000:00000000 "
                   f"00:00000000 00000000     0        0 {i} 1\n" for i in range(60_000))
    listener = (f"60000: 0100007F:{4242:04X} 00000000:0000 0A 00000000:00000000 00:00000000 "
                f"00000000 {guards.os.geteuid():5d}        0 7 1\n")
    table = tmp_path / "tcp"
    table.write_text("  sl  local_address rem_address   st\n" + rows + listener)
    monkeypatch.setattr(guards, "LOOPBACK_HEX", {str(table): "0100007F"})
    owner, readers = InnerOwner((4242,)), []
    check = owner.check

    def counted() -> bool:
        readers.append(threading.current_thread())
        return check()
    monkeypatch.setattr(owner, "check", counted)

    async def main():
        assert await asyncio.gather(*(owner.ours() for _ in range(10))) == [True] * 10
        assert await owner.ours()
    asyncio.run(main())
    assert len(readers) == 1 and readers[0] is not threading.main_thread()
    assert not InnerOwner((4243,)).check() and InnerOwner((4242,)).check()


async def _inner_http() -> tuple[web.AppRunner, int]:
    async def ok(request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query.get("hold", "0")))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/{path:.*}", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


def test_health_passes_the_request_cap_a_refusal_says_when_to_retry_origin_is_checked():
    async def main():
        inner, inner_port = await _inner_http()
        app = make_http_door(f"127.0.0.1:{inner_port}", 1 << 20, 1, 5.0)
        add_origin_guard(app, FrontConfig(), "127.0.0.1")
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        try:
            async with ClientSession() as session:
                held = asyncio.create_task(session.get(f"{url}/v2/models/m?hold=1"))
                while app[CALLS].in_flight < 1 or app[CALLS].arriving:   # forwarded
                    await asyncio.sleep(0.01)
                async with session.get(f"{url}/v2/models/m") as busy:
                    assert busy.status == 429 and busy.headers["Retry-After"] == "1"
                async with session.get(f"{url}/v2/health/live") as live:
                    assert live.status == 200               # the probe is never refused
                async with session.post(f"{url}/v2/health/live", data=b"x" * 1024) as bodied:
                    assert bodied.status == 429             # a body is no probe's
                async with session.get(f"{url}/v2/health/ready",
                                       headers={"Origin": "http://evil.example"}) as foreign:
                    assert foreign.status == 403 and "origin" in (await foreign.json())["error"]
                (await held).release()
        finally:
            await runner.cleanup()
            await inner.cleanup()
    asyncio.run(main())


def test_unknown_fields_are_dropped_and_unserved_models_refused():
    """rev27g: 10 MiB of empty unknown fields took Triton 330 MB (its protobuf keeps them);
    the door forwards messages as tritonclient's types parse them, without those; and it
    refuses a model that is not served (Triton 2.51 can die answering one on a stream)."""
    async def main():
        async with open_door(4, models=frozenset({"ensemble"})) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                call = channel.stream_stream(STREAM)()
                known = infer_request(2)
                await call.write(known + b"\x7a\x00" * 1000)       # field 15, empty: unknown
                assert await call.read() == echoed(known)
                await call.write(infer_request(1, name="nosuchmodel", request_id="r7"))
                refused = _stream_response(await call.read())
                assert "'nosuchmodel' is not served" in refused.error_message
                assert refused.infer_response.id == "r7"
                await call.write(known)                            # the stream goes on
                assert await call.read() == echoed(known)
                await call.done_writing()
                assert await call.code() == grpc.StatusCode.OK
    asyncio.run(main())


def test_a_request_id_is_bounded_and_a_refusal_echoes_at_most_its_bound():
    """rev27k H1: a refused stream message is answered in the stream with its request id,
    and Triton echoes the id in every response: a 9 MiB id on each of 64 unread answers held
    ~0.9 GB of the door a stream, outside its byte budget. An id over ``MAX_ID_CHARS`` is
    refused (in the stream; INVALID_ARGUMENT on ModelInfer), and no echo is longer."""
    async def main():
        async with open_door(4, models=frozenset({"ensemble"})) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                call = channel.stream_stream(STREAM)()
                bounded = infer_request(1, request_id="i" * MAX_ID_CHARS)
                await call.write(bounded)
                assert await call.read() == echoed(bounded)               # forwarded, echoed
                await call.write(infer_request(1, request_id="l" * (512 << 10)))
                refused = _stream_response(await call.read())
                assert f"at most {MAX_ID_CHARS}" in refused.error_message
                assert refused.infer_response.id == "l" * MAX_ID_CHARS
                await call.write(infer_request(1, name="nosuchmodel",
                                               request_id="u" * (512 << 10)))
                refused = _stream_response(await call.read())
                assert len(refused.infer_response.id) == MAX_ID_CHARS
                await call.done_writing()
                assert await call.code() == grpc.StatusCode.OK
                unary = channel.unary_unary(f"/{SERVICE}/ModelInfer")
                with pytest.raises(grpc.aio.AioRpcError) as refused_call:
                    await unary(infer_request(1, request_id="x" * (MAX_ID_CHARS + 1)))
                assert refused_call.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"at most {MAX_ID_CHARS}" in refused_call.value.details()
    asyncio.run(main())


def _stream_response(raw: bytes):
    from tritonclient.grpc import service_pb2

    return service_pb2.ModelStreamInferResponse.FromString(raw)


def test_an_inference_request_of_too_many_strings_is_refused_before_tritonserver():
    """rev27f H2: Triton's protobuf holds each string of a request as an object (a 10 MiB
    message of empty strings took ~200 MB of tritonserver); the door counts them first."""
    async def main():
        async with open_door(4, max_bytes=8 << 20) as door:
            async with grpc.aio.insecure_channel(door.address, options=[
                    ("grpc.max_send_message_length", -1)]) as channel:
                call = channel.stream_stream(STREAM)()
                small = infer_request(64)
                await call.write(small)
                assert await call.read() == echoed(small)              # forwarded, echoed
                await call.write(infer_request(MAX_ENTRIES + 1))
                refused = _stream_response(await call.read())
                assert f"at most {MAX_ENTRIES}" in refused.error_message
                from tritonclient.grpc import service_pb2

                numbers = service_pb2.ModelInferRequest(model_name="ensemble")
                ids = numbers.inputs.add(name="input_ids", datatype="INT32")
                ids.contents.int_contents.extend([0] * (MAX_NUMBERS + 1))   # 1 byte each
                packed = channel.stream_stream(STREAM)()
                await packed.write(numbers.SerializeToString())
                assert f"at most {MAX_NUMBERS}" in _stream_response(await packed.read()
                                                                     ).error_message
                unary = channel.stream_stream(f"/{SERVICE}/ModelInfer")()
                await unary.write(b"\xff\xff")
                with pytest.raises(grpc.aio.AioRpcError) as garbled:
                    await unary.read()
                assert "not a ModelInferRequest" in garbled.value.details()
    asyncio.run(main())


def test_a_call_past_the_cap_ends_the_longest_idle_one_or_is_refused():
    """rev27k M1: 64 calls that never sent a message held the door's call cap for 300 s
    from one connection; every other client was refused. A call past the cap takes the
    seat of the call idle longest (ended UNAVAILABLE); with none idle it is refused."""
    async def main():
        answer = asyncio.Event()

        async def held(requests, context):               # answers once ``answer`` is set
            async for request in requests:
                await answer.wait()
                yield request

        async with open_door(2, handler=held) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                idle = [channel.stream_stream(STREAM)() for _ in range(2)]
                for call in idle:
                    await call.wait_for_connection()
                await asyncio.sleep(0.2)
                reads = [asyncio.ensure_future(call.read()) for call in idle]
                working = channel.stream_stream(STREAM)()
                await working.write(infer_request(1))
                done, waiting = await asyncio.wait(reads, timeout=10,
                                                   return_when=asyncio.FIRST_COMPLETED)
                busy = channel.stream_stream(STREAM)()   # takes the other idle one's seat
                await busy.write(infer_request(1))
                done |= (await asyncio.wait(waiting, timeout=10))[0]
                for read in done:
                    assert isinstance(read.exception(), grpc.aio.AioRpcError)
                    assert read.exception().code() == grpc.StatusCode.UNAVAILABLE
                    assert "ended to make room" in read.exception().details()
                assert len(done) == 2
                refused = channel.stream_stream(STREAM)()   # two busy: no seat
                with pytest.raises(grpc.aio.AioRpcError) as full:
                    await refused.read()
                assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "none idle" in full.value.details()
                answer.set()
                assert await working.read() == infer_request(1)
                assert await busy.read() == infer_request(1)
                for call in (working, busy):
                    await call.done_writing()
                    assert await call.code() == grpc.StatusCode.OK
    asyncio.run(main())


def test_a_stream_of_refusals_that_reads_nothing_holds_no_seat():
    """rev27l N1: a stream that sent tiny refused messages and read nothing (its writes
    blocked) counted as busy, so 64 of them refused every other client for good. A call
    that never did work ranks first for eviction; one whose work moved within the grace
    keeps its seat."""
    async def main():
        async with open_door(2, models=frozenset({"ensemble"})) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                working = channel.stream_stream(STREAM)()
                await working.write(infer_request(1))
                assert await working.read() == echoed(infer_request(1))
                refusals = channel.stream_stream(STREAM)()
                for _ in range(3):
                    await refusals.write(infer_request(1, name="nosuchmodel"))
                await asyncio.sleep(0.2)                   # refused, answers unread
                newcomer = channel.stream_stream(STREAM)()
                await newcomer.write(infer_request(2))
                assert await newcomer.read() == echoed(infer_request(2))
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    for _ in range(4):
                        await refusals.read()
                assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
                await working.write(infer_request(3))      # kept its seat
                assert await working.read() == echoed(infer_request(3))
                for call in (working, newcomer):
                    await call.done_writing()
                    assert await call.code() == grpc.StatusCode.OK
    asyncio.run(main())

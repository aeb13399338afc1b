"""The public door's gates (issue 27 re-review rev27c), in process: an idle gRPC stream is
ended so idle clients cannot hold the call cap; health probes pass the HTTP door's request
cap and a refusal says when to retry; the HTTP door checks ``Origin`` as the front does; and
nothing is forwarded to an inner port with no listener of this user (:class:`InnerOwner`).
The inner tritonserver is an in-process stand-in (gRPC echo, aiohttp app)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import grpc
import pytest
from aiohttp import ClientSession, web

from triton_disagg.config.front_section import FrontConfig
from triton_disagg.front.http_gates import add_origin_guard
from triton_disagg.front.http_door import IN_FLIGHT, make_http_door
from triton_disagg.front.door_guards import MAX_ENTRIES, MAX_NUMBERS, MESSAGE_FLOOR, InnerOwner
from triton_disagg.front.public_door import SERVICE, GrpcDoor

STREAM = f"/{SERVICE}/ModelStreamInfer"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _stream_server(handler=None, unary=None) -> tuple[grpc.aio.Server, int]:
    """A started stand-in tritonserver whose ``ModelStreamInfer`` is ``handler`` (default:
    an echo) and whose unary methods are ``unary`` (name -> handler)."""
    async def echo(requests, context):
        async for request in requests:
            yield request

    methods = {"ModelStreamInfer": grpc.stream_stream_rpc_method_handler(handler or echo)}
    methods.update({name: grpc.unary_unary_rpc_method_handler(f)
                    for name, f in (unary or {}).items()})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, methods)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _held_until(door: GrpcDoor, held: bool, seconds: float = 10) -> int:
    """Wait up to ``seconds`` for the door's budget to hold bytes (``held``) or none; the
    bytes held then."""
    wait = time.monotonic() + seconds
    while bool(door.budget.held) != held and time.monotonic() < wait:
        await asyncio.sleep(0.05)
    return door.budget.held


@contextlib.asynccontextmanager
async def _door(max_calls: int | None = 4, max_bytes: int = 1 << 20, handler=None, unary=None,
                **kwargs):
    """A started door in front of a started stand-in (:func:`_stream_server`); both stopped
    after."""
    inner, inner_port = await _stream_server(handler, unary)
    door = GrpcDoor("127.0.0.1", _free_port(), f"127.0.0.1:{inner_port}", max_bytes, max_calls,
                    **kwargs)
    await door.start()
    try:
        yield door
    finally:
        await door.stop(0)
        await inner.stop(0)


def test_an_idle_stream_is_ended_and_a_busy_one_is_not():
    async def main():
        async with _door(idle_seconds=0.5) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                call = channel.stream_stream(STREAM)()
                begun = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    await call.read()                       # nothing sent, nothing back
                assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert time.monotonic() - begun < 5
                busy = channel.stream_stream(STREAM)()
                for i in range(6):                          # 1.2 s, a message every 0.2 s
                    message = _infer_request(1, name=f"m{i}")
                    await busy.write(message)
                    assert await busy.read() == message
                    await asyncio.sleep(0.2)
                await busy.done_writing()
    asyncio.run(main())


def test_a_unary_call_that_sends_nothing_is_ended_too():
    """rev27d: grpc.aio counts a unary call against the cap from its headers and its
    handler waited for the message without a deadline; every method is a stream now."""
    async def main():
        async with _door(1, idle_seconds=0.5) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                held = channel.stream_stream(f"/{SERVICE}/ServerLive")()   # never writes
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    await held.read()
                assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    asyncio.run(main())


def test_grpc_connections_past_the_cap_are_closed_at_once():
    """rev27d: the gRPC door had no connection cap, and idle connections could take the
    descriptors the front's other routes need."""
    async def main():
        async with _door(max_connections=2) as door:
            host, port = door.address.rsplit(":", 1)
            held = [socket.create_connection((host, int(port))) for _ in range(3)]
            try:
                await asyncio.sleep(0.5)
                first = [await asyncio.to_thread(s.recv, 9) for s in held]
                assert [len(b) > 0 for b in first] == [True, True, False]  # SETTINGS x2, EOF
            finally:
                for s in held:
                    s.close()
    asyncio.run(main())


def test_inner_owner_needs_this_users_listener_on_127_0_0_1():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert InnerOwner((port,)).ours()
        assert not InnerOwner((port, _free_port())).ours()  # one port with no listener
        with socket.socket(socket.AF_INET6) as aside:     # a v6-only wildcard beside it
            aside.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            aside.bind(("::", port))
            aside.listen()
            assert InnerOwner((port,)).ours()             # takes none of 127.0.0.1's
    assert not InnerOwner((port,)).ours()                 # closed: nobody's
    for elsewhere in ("127.0.0.2", "0.0.0.0"):
        with socket.socket() as aside:
            aside.bind((elsewhere, port))
            aside.listen()
            assert not InnerOwner((port,)).ours(), elsewhere   # not the exact listener


async def _inner_http() -> tuple[web.AppRunner, int]:
    async def ok(request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query.get("hold", "0")))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/{path:.*}", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


def test_health_passes_the_request_cap_a_refusal_says_when_to_retry_origin_is_checked():
    async def main():
        inner, inner_port = await _inner_http()
        app = make_http_door(f"127.0.0.1:{inner_port}", 1 << 20, 1, 5.0)
        add_origin_guard(app, FrontConfig(), "127.0.0.1")
        runner = web.AppRunner(app)
        await runner.setup()
        port = _free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        try:
            async with ClientSession() as session:
                held = asyncio.create_task(session.get(f"{url}/v2/models/m?hold=1"))
                while app[IN_FLIGHT][0] < 1:
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


def _infer_request(strings: int, name: str = "ensemble") -> bytes:
    """A serialized ModelInferRequest with one BYTES input of ``strings`` empty strings."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=name)
    words = request.inputs.add(name="stop_words", datatype="BYTES", shape=[1, strings])
    words.contents.bytes_contents.extend([b""] * strings)
    return request.SerializeToString()


def test_unknown_fields_are_dropped_and_unserved_models_refused():
    """rev27g: 10 MiB of empty unknown fields took Triton 330 MB (its protobuf keeps them);
    the door forwards messages as tritonclient's types parse them, without those; and it
    refuses a model that is not served (Triton 2.51 can die answering one on a stream)."""
    async def main():
        async with _door(4, models=frozenset({"ensemble"})) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                call = channel.stream_stream(STREAM)()
                known = _infer_request(2)
                await call.write(known + b"\x7a\x00" * 1000)       # field 15, empty: unknown
                assert await call.read() == known
                await call.write(_infer_request(1, name="nosuchmodel"))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call.read()
                assert "'nosuchmodel' is not served" in refused.value.details()
    asyncio.run(main())


def test_an_inference_request_of_too_many_strings_is_refused_before_tritonserver():
    """rev27f H2: Triton's protobuf holds each string of a request as an object (a 10 MiB
    message of empty strings took ~200 MB of tritonserver); the door counts them first."""
    async def main():
        async with _door(4, max_bytes=8 << 20) as door:
            async with grpc.aio.insecure_channel(door.address, options=[
                    ("grpc.max_send_message_length", -1)]) as channel:
                call = channel.stream_stream(STREAM)()
                small = _infer_request(64)
                await call.write(small)
                assert await call.read() == small              # forwarded, echoed
                await call.write(_infer_request(MAX_ENTRIES + 1))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call.read()
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"at most {MAX_ENTRIES}" in refused.value.details()
                from tritonclient.grpc import service_pb2

                numbers = service_pb2.ModelInferRequest(model_name="ensemble")
                ids = numbers.inputs.add(name="input_ids", datatype="INT32")
                ids.contents.int_contents.extend([0] * (MAX_NUMBERS + 1))   # 1 byte each
                packed = channel.stream_stream(STREAM)()
                await packed.write(numbers.SerializeToString())
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await packed.read()
                assert f"at most {MAX_NUMBERS}" in refused.value.details()
                unary = channel.stream_stream(f"/{SERVICE}/ModelInfer")()
                await unary.write(b"\xff\xff")
                with pytest.raises(grpc.aio.AioRpcError) as garbled:
                    await unary.read()
                assert "not a ModelInferRequest" in garbled.value.details()
    asyncio.run(main())


def test_a_message_holds_the_budget_until_triton_lets_its_request_go():
    """rev27f H2: one stream queued 24 messages at tritonserver (4.7 GB); rev27g: a decoupled
    request answers many times, and the door gave its bytes back at the first answer. Each
    message is its own inner call now and holds its bytes until that call ends; one past
    the budget waits until then."""
    async def main():
        arrived: list[bytes] = []
        finish: list[asyncio.Event] = []

        async def decoupled(requests, context):          # "first" at once, "last" when told
            async for request in requests:
                arrived.append(request)
                finish.append(asyncio.Event())
                done = finish[-1]
                yield b"first"
                await done.wait()
                yield b"last"

        async with _door(handler=decoupled, max_outstanding=int(2.5 * MESSAGE_FLOOR)) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                call = channel.stream_stream(STREAM)()
                for _ in range(3):
                    await call.write(_infer_request(1))
                assert [await call.read() for _ in range(2)] == [b"first", b"first"]
                await asyncio.sleep(0.3)
                assert len(arrived) == 2 and door.budget.held == 2 * MESSAGE_FLOOR
                finish[0].set()
                assert await call.read() == b"last"
                assert await call.read() == b"first"          # the room its end freed
                for event in finish:
                    event.set()
                await call.done_writing()
                assert [await call.read() for _ in range(2)] == [b"last", b"last"]
                assert await call.read() is grpc.aio.EOF
                assert await call.code() == grpc.StatusCode.OK
        assert door.budget.held == 0
    asyncio.run(main())


def test_each_message_of_a_stream_is_its_own_inner_call():
    """rev27g: Triton 2.51 aborts writing an error answer on a stream that is streaming
    another request's answers; through the door no inner stream carries two messages."""
    async def main():
        per_call: list[int] = []

        async def count(requests, context):
            n = 0
            async for request in requests:
                n += 1
                yield request
            per_call.append(n)

        async with _door(handler=count) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                call = channel.stream_stream(STREAM)()
                sent = [_infer_request(1, name=f"m{i}") for i in range(5)]
                for message in sent:
                    await call.write(message)
                await call.done_writing()
                assert sorted([r async for r in call]) == sorted(sent)
        assert per_call == [1] * 5
    asyncio.run(main())


def test_a_client_that_reads_nothing_is_ended_and_gives_its_bytes_back():
    """rev27g: the door waited on a client that read nothing for as long as it liked,
    holding its messages' bytes of the door-wide budget."""
    async def main():
        async def flood(requests, context):
            async for _ in requests:
                while True:
                    yield b"x" * (1 << 20)

        async with _door(handler=flood, write_seconds=0.5) as door:
            async with grpc.aio.insecure_channel(door.address, options=[
                    ("grpc.max_receive_message_length", -1)]) as channel:
                call = channel.stream_stream(STREAM)()
                await call.write(_infer_request(1))
                assert await _held_until(door, True) == MESSAGE_FLOOR    # forwarded, streaming
                assert await _held_until(door, False) == 0     # unread: ended, given back
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    for _ in range(1000):                          # what was on its way
                        await call.read()
                assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert "read no response" in ended.value.details()
    asyncio.run(main())


def test_cancelled_streams_give_back_every_byte():
    """rev27h H1: an inner call cancelled before its first step (the client cancels in the
    turn its message was forwarded) never ran its ``finally``: its bytes stayed held for
    good (94-166 messages of 300 streams). They are given back when the call ends, however."""
    async def main():
        async def slow_echo(requests, context):
            async for request in requests:
                await asyncio.sleep(0.05)
                yield request

        async with _door(None, handler=slow_echo) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                for _ in range(300):      # grpc's reset-flood guard ends some at once
                    call = channel.stream_stream(STREAM)()
                    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                        for _ in range(20):
                            await call.write(_infer_request(1))
                    call.cancel()
                assert await _held_until(door, False) == 0
    asyncio.run(main())


def test_one_stream_holds_at_most_its_share_and_probes_never_wait(monkeypatch):
    """rev27h H2: one client that read nothing sent 6000 small messages and held the whole
    door-wide budget (every other client, health probes too, waited). A stream has at most
    ``STREAM_CALLS`` messages at tritonserver; a small message that is not an inference
    request holds nothing of the budget."""
    from triton_disagg.front import public_door

    monkeypatch.setattr(public_door, "STREAM_CALLS", 4)

    async def main():
        arrived: list[bytes] = []

        async def never(requests, context):            # takes requests, answers none
            async for request in requests:
                arrived.append(request)
            await asyncio.Event().wait()
            yield b""

        async def live(request, context):
            return b""

        async with _door(8, handler=never, unary={"ServerLive": live},
                         max_outstanding=4 * MESSAGE_FLOOR) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                hog = channel.stream_stream(STREAM)()
                for _ in range(50):
                    await hog.write(_infer_request(1))
                await asyncio.sleep(0.5)
                assert len(arrived) == 4 and door.budget.held == 4 * MESSAGE_FLOOR
                live_call = channel.unary_unary(f"/{SERVICE}/ServerLive")
                assert await live_call(b"", timeout=5) == b""   # the budget is full
                hog.cancel()
    asyncio.run(main())


def test_a_peers_door_caps_its_calls_too(monkeypatch):
    """rev27h H3: the peers' door (context, generation) had no call cap: 40,000 idle calls
    took its process from 60 MB to 928 MB."""
    from triton_disagg.front import public_door

    monkeypatch.setattr(public_door, "PEER_CALLS", 2)

    async def main():
        async with _door(None) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                held = [channel.stream_stream(STREAM)() for _ in range(2)]
                for call in held:
                    await call.write(_infer_request(1))
                    assert await call.read() == _infer_request(1)
                third = channel.stream_stream(STREAM)()
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await third.read()
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                for call in held:
                    call.cancel()
    asyncio.run(main())


def test_the_budget_serves_takers_in_order():
    """rev27h L2: a large message waited for ever while small ones took every byte freed."""
    from triton_disagg.front.door_guards import ByteBudget

    async def main():
        budget = ByteBudget(10)
        await budget.take(6)
        large = asyncio.ensure_future(budget.take(8))
        await asyncio.sleep(0)
        small = asyncio.ensure_future(budget.take(2))   # fits now, but comes after
        await asyncio.sleep(0)
        assert not large.done() and not small.done()
        budget.give(6)
        await asyncio.sleep(0)
        assert large.done() and small.done() and budget.held == 10
        waiting = asyncio.ensure_future(budget.take(5))
        await asyncio.sleep(0)
        waiting.cancel()                                # cancelled while waiting: holds none
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        budget.give(8)
        budget.give(2)
        assert budget.held == 0
        await budget.take(0)                            # never waits
    asyncio.run(main())


def test_a_waiter_cancelled_as_bytes_are_given_back_leaks_nothing_and_probes_pass():
    """rev27i F2: a waiter cancelled in the turn another call gave bytes back was granted
    them after all (its future cancelled, its bytes counted held) and they were never
    given back: the door wedged. F1: a take of 0 (a probe) queued behind any waiter. F4:
    waiting messages are in the door's memory outside the budget; past as many bytes
    waiting as it holds, a take is refused at once."""
    from triton_disagg.front.door_guards import BudgetFull, ByteBudget

    async def main():
        budget = ByteBudget(10)
        await budget.take(5)
        waiter = asyncio.ensure_future(budget.take(10))
        await asyncio.sleep(0)
        await asyncio.wait_for(budget.take(0), 1)          # a probe passes the queue
        waiter.cancel()
        budget.give(5)                                     # the same turn
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        assert (budget.held, budget.waiting) == (0, 0)
        await asyncio.wait_for(budget.take(10), 1)
        queued = asyncio.ensure_future(budget.take(8))
        await asyncio.sleep(0)
        with pytest.raises(BudgetFull):
            await budget.take(5)                           # 8 + 5 would wait: over 10
        budget.give(10)
        await queued
        assert (budget.held, budget.waiting) == (8, 0)
    asyncio.run(main())


class _Aborted(Exception):
    """What the stand-in context raises at ``abort``, as grpc's does."""


class _SlowClient:
    """A stand-in ``ServicerContext`` whose client takes each answer in ``seconds``."""

    def __init__(self, seconds: float):
        self.seconds, self.written = seconds, 0

    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None

    async def write(self, response: bytes) -> None:
        await asyncio.sleep(self.seconds)
        self.written += 1

    async def abort(self, code, details, trailing=()):
        raise _Aborted(code, details)


class _Answers:
    """A stand-in inner call answering ``n`` responses at once."""

    def __init__(self, n: int):
        self.n = n

    async def write(self, request: bytes) -> None:
        pass

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> None:
        pass

    async def __aiter__(self):
        for _ in range(self.n):
            yield b"token"


def test_a_client_that_reads_slowly_is_ended_when_its_answers_wait_too_long():
    """rev27i F3: a client that took an answer every few seconds passed the per-write
    timeout and held its bytes of the door-wide budget for as long as it liked (50 s shown,
    one 80 MiB upload). An answer that waits in the door ``answer_seconds`` after
    tritonserver gave it ends the stream, and its bytes are given back."""
    from types import SimpleNamespace

    from triton_disagg.front.door_guards import ByteBudget
    from triton_disagg.front.public_door import _StreamRelay

    async def main():
        door = SimpleNamespace(budget=ByteBudget(1 << 20), idle_seconds=300.0,
                               write_seconds=5.0, answer_seconds=1.0, max_bytes=1 << 20)
        context = _SlowClient(0.2)                         # each write well within 5 s

        async def one_message():
            yield _infer_request(1)
            await asyncio.Event().wait()                   # the client never half-closes

        relay = _StreamRelay(door, lambda **_: _Answers(500), lambda raw: raw, context)
        begun = time.monotonic()
        with pytest.raises(_Aborted) as ended:
            await relay.run(one_message())
        assert ended.value.args[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "after tritonserver gave it" in ended.value.args[1]
        assert time.monotonic() - begun < 5 and context.written < 30
        await asyncio.sleep(0.1)                           # the cancelled calls' ends
        assert door.budget.held == 0
    asyncio.run(main())


def test_a_message_waiting_for_its_streams_share_is_counted_door_wide():
    """rev27j M1: a message that waited for its stream's share (or place) was held in the
    door's memory outside the budget: 100 streams held 100 MiB while the budget showed 1.6
    MiB. A message is read only once its stream has a place, and waits for the share holding
    its bytes of the door's budget."""
    async def main():
        arrived: list[bytes] = []

        async def never(requests, context):
            async for request in requests:
                arrived.append(request)
            await asyncio.Event().wait()
            yield b""

        from tritonclient.grpc import service_pb2

        big = service_pb2.ModelInferRequest(model_name="ensemble",
                                            raw_input_contents=[b"x" * 1_040_000])
        big = big.SerializeToString()
        async with _door(handler=never, max_outstanding=8 << 20) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                call = channel.stream_stream(STREAM)()
                await call.write(_infer_request(1))
                await call.write(big)                      # over its share: waits
                await asyncio.sleep(0.5)
                assert len(arrived) == 1
                assert door.budget.held == MESSAGE_FLOOR + len(big)
                call.cancel()
            assert await _held_until(door, False) == 0
    asyncio.run(main())

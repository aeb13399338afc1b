"""The public gRPC door's stream relay (issue 27 re-reviews rev27g-rev27j), in process: each
message of a client's stream is its own inner call; its bytes are held in the door-wide
budget until Triton lets its request go, and given back however the call ends; a stream
holds at most its share; clients that read slowly or not at all are ended; the budget serves
takers in order, refuses past as many bytes waiting as it holds, and never makes a probe
wait. The inner tritonserver is an in-process stand-in (tests/support/door_stand_in.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from door_stand_in import STREAM, held_until, infer_request, open_door

from triton_disagg.front.door_guards import MESSAGE_FLOOR
from triton_disagg.front.call_seats import Seat
from triton_disagg.front.public_door import SERVICE


def test_a_message_holds_the_budget_until_triton_lets_its_request_go():
    """rev27f H2: one stream queued 24 messages at tritonserver (4.7 GB); rev27g: a decoupled
    request answers many times, and the door gave its bytes back at the first answer. Each
    message is its own inner call now and holds its bytes until that call ends; one past
    the budget waits until then (the pool alone here: no call reserve)."""
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

        async with open_door(handler=decoupled, max_outstanding=int(2.5 * MESSAGE_FLOOR),
                             call_reserve=0) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                call = channel.stream_stream(STREAM)()
                for _ in range(3):
                    await call.write(infer_request(1))
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

        async with open_door(handler=count) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                call = channel.stream_stream(STREAM)()
                sent = [infer_request(1, name=f"m{i}") for i in range(5)]
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

        async with open_door(handler=flood, write_seconds=0.5) as door:
            async with grpc.aio.insecure_channel(door.address, options=[
                    ("grpc.max_receive_message_length", -1)]) as channel:
                call = channel.stream_stream(STREAM)()
                await call.write(infer_request(1))
                assert await held_until(door, True) == MESSAGE_FLOOR    # forwarded, streaming
                assert await held_until(door, False) == 0     # unread: ended, given back
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

        async with open_door(None, handler=slow_echo) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                for _ in range(300):      # grpc's reset-flood guard ends some at once
                    call = channel.stream_stream(STREAM)()
                    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                        for _ in range(20):
                            await call.write(infer_request(1))
                    call.cancel()
                assert await held_until(door, False) == 0
    asyncio.run(main())


def test_one_stream_holds_at_most_its_share_and_probes_never_wait(monkeypatch):
    """rev27h H2: one client that read nothing sent 6000 small messages and held the whole
    door-wide budget (every other client, health probes too, waited). A stream has at most
    ``STREAM_CALLS`` messages at tritonserver; a small message that is not an inference
    request holds nothing of the budget (the pool alone here: no call reserve)."""
    from triton_disagg.front import door_relay

    monkeypatch.setattr(door_relay, "STREAM_CALLS", 4)

    async def main():
        arrived: list[bytes] = []

        async def never(requests, context):            # takes requests, answers none
            async for request in requests:
                arrived.append(request)
            await asyncio.Event().wait()
            yield b""

        async def live(request, context):
            return b""

        async with open_door(8, handler=never, unary={"ServerLive": live},
                             max_outstanding=4 * MESSAGE_FLOOR, call_reserve=0) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                hog = channel.stream_stream(STREAM)()
                for _ in range(50):
                    await hog.write(infer_request(1))
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
        async def first_only(requests, context):      # a request that stays at tritonserver
            async for request in requests:
                yield request
                await asyncio.Event().wait()

        async with open_door(None, handler=first_only) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                held = [channel.stream_stream(STREAM)() for _ in range(2)]
                for call in held:
                    await call.write(infer_request(1))
                    assert await call.read() == infer_request(1)
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
        first = await budget.take(6)
        large = asyncio.ensure_future(budget.take(8))
        await asyncio.sleep(0)
        small = asyncio.ensure_future(budget.take(2))   # fits now, but comes after
        await asyncio.sleep(0)
        assert not large.done() and not small.done()
        budget.give(first)
        await asyncio.sleep(0)
        assert large.done() and small.done() and budget.held == 10
        waiting = asyncio.ensure_future(budget.take(5))
        await asyncio.sleep(0)
        waiting.cancel()                                # cancelled while waiting: holds none
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        budget.give(large.result())
        budget.give(small.result())
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
        five = await budget.take(5)
        waiter = asyncio.ensure_future(budget.take(10))
        await asyncio.sleep(0)
        await asyncio.wait_for(budget.take(0), 1)          # a probe passes the queue
        waiter.cancel()
        budget.give(five)                                  # the same turn
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        assert (budget.held, budget.waiting) == (0, 0)
        ten = await asyncio.wait_for(budget.take(10), 1)
        queued = asyncio.ensure_future(budget.take(8))
        await asyncio.sleep(0)
        with pytest.raises(BudgetFull):
            await budget.take(5)                           # 8 + 5 would wait: over 10
        budget.give(ten)
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
    from triton_disagg.front.door_guards import ByteBudget, LoopClock
    from triton_disagg.front.door_relay import RelayLimits, StreamRelay

    async def main():
        budget = ByteBudget(1 << 20)
        limits = RelayLimits(1 << 20, idle_seconds=300.0, write_seconds=5.0,
                             answer_seconds=1.0)
        context = _SlowClient(0.2)                         # each write well within 5 s

        async def one_message():
            yield infer_request(1)
            await asyncio.Event().wait()                   # the client never half-closes

        relay = StreamRelay(budget, LoopClock(), limits, lambda **_: _Answers(500),
                            lambda raw: raw, context, Seat(0.0))
        begun = time.monotonic()
        with pytest.raises(_Aborted) as ended:
            await relay.run(one_message())
        assert ended.value.args[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "after tritonserver gave it" in ended.value.args[1]
        assert time.monotonic() - begun < 5 and context.written < 30
        await asyncio.sleep(0.1)                           # the cancelled calls' ends
        assert budget.held == 0
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
        async with open_door(handler=never, max_outstanding=8 << 20) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                call = channel.stream_stream(STREAM)()
                await call.write(infer_request(1))
                await call.write(big)                      # over its share: waits
                await asyncio.sleep(0.5)
                assert len(arrived) == 1
                assert door.budget.held + door.budget.reserved == MESSAGE_FLOOR + len(big)
                call.cancel()
            assert await held_until(door, False) == 0
    asyncio.run(main())


class _StallingClient(_SlowClient):
    """A client that takes every answer at once, but whose first write stalls the door's
    event loop for ``seconds`` (as parsing a 10 MiB message on it does)."""

    async def write(self, response: bytes) -> None:
        if not self.written:
            time.sleep(self.seconds)
        self.written += 1


def test_a_stall_of_the_doors_own_loop_does_not_end_a_prompt_client():
    """rev27j M2: the door's event loop busy (a 10 MiB message of an unknown model took ~90
    ms to parse; many in a row) made the answers of a client that reads at once look late,
    and the door ended it. The door times clients on its loop clock, less (half) its loop's
    lag."""
    from triton_disagg.front.door_guards import ByteBudget, LoopClock
    from triton_disagg.front.door_relay import RelayLimits, StreamRelay

    async def main():
        clock, budget = LoopClock(), ByteBudget(1 << 20)
        clock.start()
        limits = RelayLimits(1 << 20, idle_seconds=300.0, write_seconds=0.5,
                             answer_seconds=0.5)
        context = _StallingClient(0.8)                     # 0.4 s of it counted

        async def one_message():
            yield infer_request(1)

        relay = StreamRelay(budget, clock, limits, lambda **_: _Answers(20), lambda raw: raw,
                            context, Seat(0.0))
        await relay.run(one_message())                     # not _Aborted
        await clock.stop()
        assert context.written == 20 and budget.held == 0
        assert clock.lag >= 0.35
    asyncio.run(main())

"""Each call's reserve of the doors' byte budget (issue 27, rev27k M2): 8 streams each
sending one accepted ~10 MiB message to a model that streamed for 40 s held 79 of the
door's 80 MiB, and a victim's small ModelInfer waited 38.6 s (an HTTP door request would
have waited its body timeout, then 503). A call's bytes come from its own reserve first,
at once, and only the rest from the shared pool: a small request is never held up by
others' large ones, which still wait for the pool. The inner tritonserver is an in-process
stand-in (tests/support/door_stand_in.py), the HTTP one an aiohttp app."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from aiohttp import ClientSession, web
from door_stand_in import STREAM, infer_request, open_door
from local_sites import serve_locally

from triton_disagg.front.door_guards import (CALL_RESERVE, MESSAGE_FLOOR, BudgetFull,
                                             ByteBudget, Taken)
from triton_disagg.front.http_door import make_http_door
from triton_disagg.front.public_door import SERVICE

MAX_BYTES = 2**20
LARGE = 64 * 1024           # a stand-in request past this is an attacker's: never answered


def test_a_take_comes_from_its_calls_reserve_first_and_gives_back_what_it_took():
    async def main():
        budget = ByteBudget(100, per_call=10)
        reserve = budget.reserve()
        small = await budget.take(4, reserve)
        assert small == Taken(reserve, 4, 0) and (budget.held, budget.reserved) == (0, 4)
        large = await budget.take(10, reserve)              # the reserve's rest, then the pool
        assert large == Taken(reserve, 6, 4) and (budget.held, budget.reserved) == (4, 10)
        assert await budget.take(0, reserve) == Taken(reserve, 0, 0)
        budget.give(small)
        assert (budget.held, budget.reserved, reserve.held) == (4, 6, 6)
        budget.give(large)
        assert (budget.held, budget.reserved, reserve.held) == (0, 0, 0)
        assert await budget.take(3) == Taken(None, 0, 3)   # no call's: the pool alone
    asyncio.run(main())


def test_a_small_take_never_waits_for_a_full_pool_and_a_failed_one_holds_nothing():
    async def main():
        budget = ByteBudget(100, per_call=10)
        hog = await budget.take(100)
        queued = asyncio.ensure_future(budget.take(50))     # the pool is full: waits
        await asyncio.sleep(0)
        victim = await asyncio.wait_for(budget.take(8, budget.reserve()), 1)
        assert victim.pooled == 0 and not queued.done()
        waiter_reserve = budget.reserve()
        waiter = asyncio.ensure_future(budget.take(12, waiter_reserve))   # 2 of the pool
        await asyncio.sleep(0)
        assert (waiter_reserve.held, budget.waiting) == (10, 52) and not waiter.done()
        waiter.cancel()                                     # cancelled while waiting
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        assert (waiter_reserve.held, budget.reserved, budget.waiting) == (0, 8, 50)
        refused_reserve = budget.reserve()
        with pytest.raises(BudgetFull):
            await budget.take(70, refused_reserve)          # 50 + 60 would wait: over 100
        assert (refused_reserve.held, budget.reserved) == (0, 8)
        budget.give(hog)
        budget.give(await queued)
        budget.give(victim)
        assert (budget.held, budget.reserved, budget.waiting) == (0, 0, 0)
    asyncio.run(main())


def test_a_clients_door_reserves_a_request_a_peers_door_one_floor():
    async def main():
        async with open_door(4) as clients, open_door(None) as peers:
            assert clients.budget.per_call == CALL_RESERVE
            assert peers.budget.per_call == MESSAGE_FLOOR
    asyncio.run(main())


def _attack() -> bytes:
    """An accepted inference request of almost ``MAX_BYTES`` (a string parameter Triton
    would hand the model)."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="ensemble")
    request.parameters["pad"].string_param = "x" * (MAX_BYTES - 200)
    return request.SerializeToString()


async def _slow_model(requests, context):
    """Answers a small request at once; an attacker's streams for ever."""
    async for request in requests:
        if len(request) > LARGE:
            await asyncio.Event().wait()
        yield request


async def _answer(request, context):
    return b"answered"


@contextlib.asynccontextmanager
async def _http_door(budget: ByteBudget, body_timeout: float):
    """The HTTP door's URL, in front of a stand-in that answers at once, on ``budget``."""
    async def inner(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"answered")

    inner_app = web.Application()
    inner_app.router.add_route("*", "/{path:.*}", inner)
    inner_runner, inner_port = await serve_locally(inner_app)
    door, port = await serve_locally(make_http_door(
        f"127.0.0.1:{inner_port}", MAX_BYTES, 8, body_timeout, budget=budget))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await door.cleanup()
        await inner_runner.cleanup()


def test_a_small_request_is_answered_at_once_while_large_ones_hold_the_pool():
    """rev27k M2, scaled down: three streams each send one accepted message of ~1 MiB to a
    model that never ends them; the pool (2 MiB) is full and one waits for it. A victim's
    small ModelInfer, a small message on a stream of its own and an HTTP door request (on
    the same budget) are each answered at once (main's door: they waited for the pool)."""
    async def main():
        async with open_door(16, MAX_BYTES, handler=_slow_model,
                             unary={"ModelInfer": _answer},
                             max_outstanding=2 * MAX_BYTES) as door:
            attack = _attack()
            async with grpc.aio.insecure_channel(door.address) as channel:
                attackers = [channel.stream_stream(STREAM)() for _ in range(3)]
                for call in attackers:
                    await call.write(attack)
                deadline = time.monotonic() + 5
                while not door.budget.waiting and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert door.budget.waiting and door.budget.held > MAX_BYTES   # pool full
                async with grpc.aio.insecure_channel(door.address) as victim:
                    begun = time.monotonic()
                    unary = victim.unary_unary(f"/{SERVICE}/ModelInfer")
                    assert await unary(infer_request(1), timeout=5) == b"answered"
                    stream = victim.stream_stream(STREAM)()
                    await stream.write(infer_request(1))
                    assert await asyncio.wait_for(stream.read(), 5) == infer_request(1)
                    stream.cancel()
                    async with _http_door(door.budget, 5.0) as url:
                        async with ClientSession() as session:
                            async with session.post(f"{url}/v2/models/ensemble/infer",
                                                    data=b"{}") as http:
                                assert (http.status, await http.read()) == (200, b"answered")
                    assert time.monotonic() - begun < 2
                assert door.budget.waiting                       # the attackers still wait
                for call in attackers:
                    call.cancel()
    asyncio.run(main())

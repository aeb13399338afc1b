"""The gRPC door's connection gate (triton_disagg/front/grpc_admission.py): at the cap a new
connection takes the place of one none of whose calls works, else it is closed at once;
every call goes through the gate's pipe unchanged. In process, with a stand-in
tritonserver (tests/support/door_stand_in.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import grpc
import pytest
from door_stand_in import STREAM, echoed, infer_request, open_door

from triton_disagg.front import call_seats, grpc_admission
from triton_disagg.front.public_door import SERVICE

OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]   # a channel never shares one


async def _closed(host: str, port: int, seconds: float = 3.0) -> bool:
    """Whether a new raw connection is closed by the door within ``seconds`` (else it is
    held open, and closed here)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(65536):
                pass                                          # the server's SETTINGS
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        writer.close()


async def _victim_served_beside(door, call_once, pause: float, settle: float) -> None:
    """Four connections each making ``call_once(channel)`` every ``pause`` s, at the gate's
    cap of four; a victim on a new connection is answered three times of three."""
    stop = asyncio.Event()

    async def hold() -> None:
        async with grpc.aio.insecure_channel(door.address, options=OWN_CONNECTION) as channel:
            while not stop.is_set():
                await call_once(channel)
                await asyncio.sleep(pause)
    holders = [asyncio.ensure_future(hold()) for _ in range(4)]
    try:
        await asyncio.sleep(settle)
        for _ in range(3):
            async with grpc.aio.insecure_channel(door.address) as victim:
                assert await victim.unary_unary(f"/{SERVICE}/ModelInfer")(
                    infer_request(1), timeout=5) == infer_request(1)
    finally:
        stop.set()
        await asyncio.gather(*holders, return_exceptions=True)


def test_a_connection_past_the_cap_takes_an_idle_ones_place_or_is_closed(monkeypatch):
    """rev27d: idle connections could take the descriptors the front needs (grpcio's cap
    closed a new one at once); rev27l M1b: so clients that kept idle ones open held every
    place. Now two working connections keep theirs (a third is closed at once), and once
    their work is past the grace, a newcomer takes the place of the one idle longest."""
    monkeypatch.setattr(grpc_admission, "EVICT_GRACE_SECONDS", 0.3)     # connections'
    monkeypatch.setattr(call_seats, "EVICT_GRACE_SECONDS", 0.3)         # and calls' grace

    async def main():
        answer = asyncio.Event()

        async def held(requests, context):
            async for request in requests:
                await answer.wait()
                yield request

        async with open_door(4, handler=held, max_connections=2) as door:
            host, port = door.address.rsplit(":", 1)
            first, second = (grpc.aio.insecure_channel(door.address, options=OWN_CONNECTION)
                             for _ in range(2))
            calls = [channel.stream_stream(STREAM)() for channel in (first, second)]
            for call in calls:
                await call.write(infer_request(1))
            await asyncio.sleep(0.3)
            assert await _closed(host, int(port))                 # both work: no place
            answer.set()
            for call in calls:
                assert await call.read() == infer_request(1)
                await call.done_writing()
                assert await call.code() == grpc.StatusCode.OK
            await asyncio.sleep(0.5)                             # past the grace: idle
            assert not await _closed(host, int(port), 0.5)       # took the idle one's place
            assert door.gate.evicted == 1 and door.gate.refused == 1
            for channel in (first, second):
                await channel.close()
    asyncio.run(main())


def test_reconnecting_silent_clients_hold_no_place():
    """rev27l M1b: eight connections that sent nothing and reconnected as soon as the door
    closed each one held grpcio's cap of 8: a victim failed 15 of 15 tries over 30 s. Now
    they take each other's places (the most connections from one address go first)."""
    async def ok(request, context):
        return request

    async def main():
        async with open_door(4, unary={"ModelInfer": ok}, max_connections=4) as door:
            host, port = door.address.rsplit(":", 1)
            stop = asyncio.Event()

            async def silent() -> None:                # reconnects as each is closed
                while not stop.is_set():
                    try:
                        reader, writer = await asyncio.open_connection(
                            host, int(port), local_addr=("127.0.0.2", 0))
                        await reader.read()
                        writer.close()
                        await asyncio.sleep(0.005)     # ~1,600 connects a second in all
                    except OSError:
                        await asyncio.sleep(0.05)
            attackers = [asyncio.ensure_future(silent()) for _ in range(8)]
            await asyncio.sleep(0.5)
            answers = []
            for _ in range(3):
                async with grpc.aio.insecure_channel(door.address) as victim:
                    answers.append(await victim.unary_unary(f"/{SERVICE}/ModelInfer")(
                        infer_request(1), timeout=5))
            stop.set()
            for task in attackers:
                task.cancel()
            assert answers == [infer_request(1)] * 3
            assert door.gate.evicted > 0
    asyncio.run(main())


def test_connections_that_only_make_empty_calls_hold_no_place():
    """rev27l M1b: connections that started a header-only call every few seconds were never
    idle to grpcio; a victim failed 10 of 10 tries over 50 s. A connection whose calls never
    did work ranks first for eviction."""
    async def ok(request, context):
        return request

    async def main():
        async def empty_call(channel: grpc.aio.Channel) -> None:
            asyncio.ensure_future(channel.stream_stream(STREAM)().wait_for_connection())

        async with open_door(4, unary={"ModelInfer": ok}, max_connections=4) as door:
            await _victim_served_beside(door, empty_call, pause=0.2, settle=0.5)
    asyncio.run(main())


def test_the_gate_pipes_large_messages_both_ways_and_tells_calls_by_connection():
    """Every byte goes through the pipe (a ~1 MB message and its echo, on two connections
    at once), and each call's work is counted on the connection it came on."""
    async def main():
        async with open_door(4, max_bytes=2 << 20) as door:
            from tritonclient.grpc import service_pb2

            request = service_pb2.ModelInferRequest(model_name="ensemble")
            request.inputs.add(name="input_ids", datatype="INT32", shape=[1, 250_000])
            request.raw_input_contents.append(bytes(range(256)) * 3_907)    # ~1 MB
            payload = request.SerializeToString()
            channels = [grpc.aio.insecure_channel(door.address, options=OWN_CONNECTION)
                        for _ in range(2)]

            async def one(channel) -> bytes:
                call = channel.stream_stream(STREAM)()
                await call.write(payload)
                answer = await call.read()
                await call.done_writing()
                return answer
            assert await asyncio.gather(*(one(c) for c in channels)) == [echoed(payload)] * 2
            await asyncio.sleep(0.2)                            # the calls leave their seats
            connections = list(door.gate.roster.seats)
            assert len(connections) == 2 and all(c.worked for c in connections)
            for channel in channels:
                await channel.close()
    asyncio.run(main())


@pytest.mark.parametrize("peer", ["ipv6:[::1]:5", "ipv4:127.0.0.2:5", "unix:/x", "ipv4:bad"])
def test_a_call_not_from_the_gate_belongs_to_no_connection(peer):
    gate = grpc_admission.ConnectionGate("127.0.0.1", 0, 1, 1, clock=None)
    gate.by_port[5] = object()
    assert gate.connection(peer) is None
    assert gate.connection("ipv4:127.0.0.1:5") is gate.by_port[5]


def test_stopping_the_door_ends_every_piped_connection():
    """Stopping the door ends every piped connection (none is left open)."""
    async def main():
        async with open_door(4) as door:
            host, port = door.address.rsplit(":", 1)
            held = socket.create_connection((host, int(port)))
            await asyncio.sleep(0.2)
            assert len(door.gate.roster.seats) == 1
        assert not door.gate.roster.seats
        held.close()
    asyncio.run(main())


def test_connections_that_make_only_health_calls_hold_no_place():
    """rev27m M-A: eight connections each calling ServerLive every 1.5 s held the gate's cap
    of 8 (a victim failed 15 of 15): any answered call counted as the connection's work."""
    async def ok(request, context):
        return request

    async def health_call(channel: grpc.aio.Channel) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await channel.unary_unary(f"/{SERVICE}/ServerLive")(b"", timeout=2)

    async def main():
        async with open_door(8, unary={"ModelInfer": ok, "ServerLive": ok},
                             max_connections=4) as door:
            await _victim_served_beside(door, health_call, pause=0.3, settle=1.0)
    asyncio.run(main())


def test_a_connect_flood_at_the_cap_costs_no_ranking_each(monkeypatch):
    """rev27m H-B: at the cap every new connection ranked every open one (~1 ms at 512) on
    the doors' loop: 800 connects a second stalled every client of the front for seconds.
    Now a newcomer takes the place of the oldest silent connection, of its own address
    when that holds more than its share (no ranking; a silent connection has no pipe, so
    each costs an accept and a close); rev27n N-B: no allowance shared by all addresses
    that a flood could spend to lock every newcomer out. A client of another address
    still gets in."""
    async def ok(request, context):
        return request

    async def main():
        async with open_door(4, unary={"ModelInfer": ok}, max_connections=4) as door:
            host, port = door.address.rsplit(":", 1)
            rankings = []
            rank = grpc_admission.GatedConnection.rank

            def counted(connection):
                rankings.append(connection)
                return rank(connection)
            monkeypatch.setattr(grpc_admission.GatedConnection, "rank", counted)
            held = []
            for _ in range(200):                            # one address
                held.append(await asyncio.open_connection(host, int(port),
                                                          local_addr=("127.0.0.2", 0)))
            assert len(rankings) <= 2 * 200                 # a look or two each, no scan
            assert door.gate.evicted >= 190 and door.gate.refused == 0
            async with grpc.aio.insecure_channel(door.address) as victim:
                assert await victim.unary_unary(f"/{SERVICE}/ModelInfer")(
                    infer_request(1), timeout=5) == infer_request(1)
            for _, writer in held:
                writer.close()
    asyncio.run(main())


def test_an_address_over_its_share_makes_room_by_a_look_at_its_oldest():
    """rev27o O-2: connections that each sent a byte are not silent, so a newcomer of an
    address over its share (behind NAT: the victim's own) had to draw on the address's
    allowance of 64 rankings a second, which a flood spent. Now it takes the first to take
    of its address's 8 oldest connections, no ranking and no allowance drawn."""
    async def ok(request, context):
        return request

    async def main():
        async with open_door(4, unary={"ModelInfer": ok}, max_connections=4) as door:
            host, port = door.address.rsplit(":", 1)
            spoken = [await asyncio.open_connection(host, int(port)) for _ in range(4)]
            for _, writer in spoken:
                writer.write(b"PRI * HTTP/2.0")           # a preface begun, never ended
            await asyncio.sleep(0.3)
            assert not door.gate.silent and len(door.gate.roster.seats) == 4
            async with grpc.aio.insecure_channel(door.address) as victim:
                assert await victim.unary_unary(f"/{SERVICE}/ModelInfer")(
                    infer_request(1), timeout=5) == infer_request(1)
            assert door.gate.evicted >= 1
            for _, writer in spoken:
                writer.close()
    asyncio.run(main())


def test_a_speaking_flood_from_one_address_leaves_another_address_served():
    """The gate's unit of fairness is the source address (docs/architecture.md, the public
    door): clients behind one address share its places, so one of them opening connections
    that each send a byte, flat out, can crowd out its neighbours (rev27p O-2), but not a
    client of another address, whose new connections are all served."""
    async def ok(request, context):
        return request

    async def main():
        async with open_door(4, unary={"ModelInfer": ok}, max_connections=4) as door:
            host, port = door.address.rsplit(":", 1)
            stop, opened = asyncio.Event(), []

            async def flood() -> None:
                while not stop.is_set():
                    _, writer = await asyncio.open_connection(host, int(port),
                                                              local_addr=("127.0.0.2", 0))
                    writer.write(b"P")                    # spoke: not silent
                    opened.append(writer)
                    await asyncio.sleep(0)
            flooding = asyncio.ensure_future(flood())
            try:
                await asyncio.sleep(0.3)
                for i in range(8):
                    async with grpc.aio.insecure_channel(door.address,
                                                         options=OWN_CONNECTION) as victim:
                        assert await victim.unary_unary(f"/{SERVICE}/ModelInfer")(
                            infer_request(i), timeout=5) == infer_request(i)
            finally:
                stop.set()
                await flooding
                for writer in opened:
                    writer.close()
            assert len(opened) >= 100 and door.gate.evicted >= 90
    asyncio.run(main())

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

from triton_disagg.front import grpc_admission
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


def test_a_connection_past_the_cap_takes_an_idle_ones_place_or_is_closed(monkeypatch):
    """rev27d: idle connections could take the descriptors the front needs (grpcio's cap
    closed a new one at once); rev27l M1b: so clients that kept idle ones open held every
    place. Now two working connections keep theirs (a third is closed at once), and once
    their work is past the grace, a newcomer takes the place of the one idle longest."""
    monkeypatch.setattr(grpc_admission, "EVICT_GRACE_SECONDS", 0.3)

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
        async with open_door(4, unary={"ModelInfer": ok}, max_connections=4) as door:
            stop = asyncio.Event()

            async def hold() -> None:
                async with grpc.aio.insecure_channel(door.address,
                                                     options=OWN_CONNECTION) as channel:
                    while not stop.is_set():
                        call = channel.stream_stream(STREAM)()
                        asyncio.ensure_future(call.wait_for_connection())
                        await asyncio.sleep(0.2)
            holders = [asyncio.ensure_future(hold()) for _ in range(4)]
            await asyncio.sleep(0.5)
            for _ in range(3):
                async with grpc.aio.insecure_channel(door.address) as victim:
                    assert await victim.unary_unary(f"/{SERVICE}/ModelInfer")(
                        infer_request(1), timeout=5) == infer_request(1)
            stop.set()
            await asyncio.gather(*holders, return_exceptions=True)
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


def _blocked_unary_calls(address: str, method: str, body: bytes, calls: int) -> socket.socket:
    """A raw HTTP/2 connection that opens ``calls`` unary ``method`` calls and lets the door
    write nothing back (its flow-control window 0, never opened): each answer waits."""
    import h2.config
    import h2.connection
    import h2.settings

    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    h2c.initiate_connection()
    h2c.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    for _ in range(calls):
        stream = h2c.get_next_available_stream_id()
        h2c.send_headers(stream, [(":method", "POST"), (":scheme", "http"),
                                  (":path", f"/{SERVICE}/{method}"), (":authority", "door"),
                                  ("content-type", "application/grpc"), ("te", "trailers")])
        h2c.send_data(stream, b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True)
    sock.sendall(h2c.data_to_send())
    return sock


def _closed_by_peer(sock: socket.socket, seconds: float = 5.0) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize("method", ["ServerLive", "ModelInfer"])
def test_unary_calls_whose_answers_are_never_read_hold_no_seat(monkeypatch, method):
    """rev27m H-A: a unary call stayed "at work" while its answer waited for a client that
    read nothing, so one connection of such calls (270 bytes/s) refused 41 of 42 calls of
    everyone else. Now a call is at work only while it waits for bytes or is at
    tritonserver; an answered inference then ranks as work done (kept within the grace), any
    other answer as none. A call ended for room mid-answer finishes its write in the
    client's time; one the client does not take in time ends its connection (else grpcio
    counts its stuck status against its call cap: 64 such calls every 10 s filled it)."""
    monkeypatch.setattr(grpc_admission, "EVICT_GRACE_SECONDS", 0.3)

    async def ok(request, context):
        return request

    async def main():
        async with open_door(4, unary={"ModelInfer": ok, "ServerLive": ok},
                             write_seconds=1.0) as door:
            body = b"" if method == "ServerLive" else infer_request(1)
            attacker = await asyncio.to_thread(_blocked_unary_calls, door.address, method,
                                               body, 4)
            try:
                await asyncio.sleep(0.6)                     # answered, past the grace
                assert len(door.roster.seats) == 4
                async with grpc.aio.insecure_channel(door.address) as victim:
                    for _ in range(3):
                        assert await victim.unary_unary(f"/{SERVICE}/ModelInfer")(
                            infer_request(1), timeout=5) == infer_request(1)
                assert await asyncio.to_thread(_closed_by_peer, attacker)
            finally:
                attacker.close()
    asyncio.run(main())


def test_a_stream_whose_requests_triton_refuses_holds_no_seat(monkeypatch):
    """rev27m M-A, on streams: a request Triton answers with an error counted as work, so a
    stream sending one every second kept its seat for good. Only answers are work."""
    from tritonclient.grpc import service_pb2

    monkeypatch.setattr(grpc_admission, "EVICT_GRACE_SECONDS", 0.5)
    refusal = service_pb2.ModelStreamInferResponse(error_message="bad input").SerializeToString()

    async def refuse(requests, context):
        async for _ in requests:
            yield refusal

    async def main():
        async with open_door(1, handler=refuse) as door:
            async with grpc.aio.insecure_channel(door.address) as channel:
                refused = channel.stream_stream(STREAM)()
                for _ in range(3):
                    await refused.write(infer_request(1))
                    assert await refused.read() == refusal
                    await asyncio.sleep(0.1)
                newcomer = channel.stream_stream(STREAM)()
                await newcomer.write(infer_request(1))
                assert await newcomer.read() == refusal          # it took the seat
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    await refused.read()
                assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    asyncio.run(main())


def test_connections_that_make_only_health_calls_hold_no_place():
    """rev27m M-A: eight connections each calling ServerLive every 1.5 s held the gate's cap
    of 8 (a victim failed 15 of 15): any answered call counted as the connection's work."""
    async def ok(request, context):
        return request

    async def main():
        async with open_door(8, unary={"ModelInfer": ok, "ServerLive": ok},
                             max_connections=4) as door:
            stop = asyncio.Event()

            async def live() -> None:
                async with grpc.aio.insecure_channel(door.address,
                                                     options=OWN_CONNECTION) as channel:
                    while not stop.is_set():
                        with contextlib.suppress(grpc.aio.AioRpcError):
                            await channel.unary_unary(f"/{SERVICE}/ServerLive")(b"", timeout=2)
                        await asyncio.sleep(0.3)
            holders = [asyncio.ensure_future(live()) for _ in range(4)]
            await asyncio.sleep(1.0)
            for _ in range(3):
                async with grpc.aio.insecure_channel(door.address) as victim:
                    assert await victim.unary_unary(f"/{SERVICE}/ModelInfer")(
                        infer_request(1), timeout=5) == infer_request(1)
            stop.set()
            await asyncio.gather(*holders, return_exceptions=True)
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


def test_a_call_ended_for_room_mid_answer_finishes_its_write():
    """rev27n N-A: a call ended for room while it wrote an answer was cancelled, and so its
    connection (another call of it at tritonserver too) was ended, though its client read
    in time. Now it is detached: its write finishes in the client's time; past
    MAX_DETACHED such calls at once, its connection is ended."""
    async def main():
        gate = grpc_admission.ConnectionGate("127.0.0.1", 0, 1, 4, clock=None)
        connection = grpc_admission.GatedConnection.__new__(grpc_admission.GatedConnection)
        connection.gate, connection.detached, connection.ended = gate, 0, False
        connection.end = lambda: setattr(connection, "ended", True)
        seats = []
        for writing in [False] + [True] * (grpc_admission.MAX_DETACHED + 1):
            task = asyncio.ensure_future(asyncio.sleep(10))
            seat = grpc_admission.Seat(0.0)
            seat.task, seat.writing, seat.connection = task, writing, connection
            seat.evict()
            seats.append((seat, task))
        await asyncio.sleep(0)
        assert seats[0][1].cancelled() and not seats[0][0].detached    # not writing: ended
        assert all(not task.cancelled() and seat.detached for seat, task in seats[1:])
        assert connection.detached == grpc_admission.MAX_DETACHED + 1 and connection.ended
        for _, task in seats:
            task.cancel()
    asyncio.run(main())


def test_a_call_waiting_for_the_byte_pool_holds_no_seat():
    """rev27n N-C: calls waiting for the door's byte pool counted as at work, so large
    requests held at tritonserver plus a few waiters filled every seat (a victim refused 18
    of 18). A waiter holds nothing: it is ended for room like an idle call."""
    hold = asyncio.Event()

    async def held(request, context):
        if len(request) > 100_000:
            await hold.wait()
        return request

    async def main():
        from tritonclient.grpc import service_pb2

        big = service_pb2.ModelInferRequest(model_name="ensemble")
        big.inputs.add(name="input_ids", datatype="INT32", shape=[1, 250_000])
        big.raw_input_contents.append(bytes(1_000_000))
        large = big.SerializeToString()
        async with open_door(2, max_bytes=2 << 20, max_outstanding=1 << 20,
                             unary={"ModelInfer": held}) as door:
            async with grpc.aio.insecure_channel(door.address, options=[
                    ("grpc.max_send_message_length", -1)]) as channel:
                infer = channel.unary_unary(f"/{SERVICE}/ModelInfer")
                at_triton = asyncio.ensure_future(infer(large, timeout=30))
                await asyncio.sleep(0.3)
                waiting = asyncio.ensure_future(infer(large, timeout=30))
                await asyncio.sleep(0.3)
                assert await infer(infer_request(1), timeout=5) == infer_request(1)
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    await waiting
                assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
                hold.set()
                assert await at_triton == large
    asyncio.run(main())

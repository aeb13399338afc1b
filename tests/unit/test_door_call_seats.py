"""The public gRPC door's call seats (triton_disagg/front/call_seats.py ``Seat`` and
``Roster``, as triton_disagg/front/public_door.py uses them): only answered inference is
work, a call whose answer waits for a client that reads nothing holds no seat, a call ended
for room mid-answer finishes its write, a call waiting for the byte pool holds no seat. In
process, with a stand-in tritonserver (tests/support/door_stand_in.py)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from door_stand_in import STREAM, infer_request, open_door
from waiting import wait_until_async

from triton_disagg.front import call_seats, grpc_admission
from triton_disagg.front.public_door import SERVICE


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
    monkeypatch.setattr(call_seats, "EVICT_GRACE_SECONDS", 0.3)

    async def ok(request, context):
        return request

    async def main():
        async with open_door(4, unary={"ModelInfer": ok, "ServerLive": ok},
                             write_seconds=1.0) as door:
            body = b"" if method == "ServerLive" else infer_request(1)
            attacker = await asyncio.to_thread(_blocked_unary_calls, door.address, method,
                                               body, 4)
            try:
                await wait_until_async(                      # answered, past the grace
                    lambda: len(door.roster.seats) == 4
                    and all(seat.rank() is not None for seat in door.roster.seats),
                    10.0, "the 4 answered calls past their grace")
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

    monkeypatch.setattr(call_seats, "EVICT_GRACE_SECONDS", 0.5)
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


def test_a_call_ended_for_room_mid_answer_finishes_its_write():
    """rev27n N-A: a call ended for room while it wrote an answer was cancelled, and so its
    connection (another call of it at tritonserver too) was ended, though its client read
    in time. Now it is detached: its write finishes in the client's time, its other work
    stopped (rev27o O-1: a detached stream went on reading and calling tritonserver outside
    the cap: 960 calls at once through a cap of 4); past MAX_DETACHED such calls at once,
    its connection is ended."""
    async def main():
        gate = grpc_admission.ConnectionGate("127.0.0.1", 0, 1, 4, clock=None)
        connection = grpc_admission.GatedConnection.__new__(grpc_admission.GatedConnection)
        connection.gate, connection.detached, connection.ended = gate, 0, False
        connection.end = lambda: setattr(connection, "ended", True)
        seats, stopped = [], []
        for writing in [False] + [True] * (call_seats.MAX_DETACHED + 1):
            task = asyncio.ensure_future(asyncio.sleep(10))
            seat = call_seats.Seat(0.0)
            seat.task, seat.writing, seat.connection = task, writing, connection
            seat.stop_work = lambda seat=seat: stopped.append(seat)
            seat.evict()
            seats.append((seat, task))
        await asyncio.sleep(0)
        assert seats[0][1].cancelled() and not seats[0][0].detached    # not writing: ended
        assert all(not task.cancelled() and seat.detached for seat, task in seats[1:])
        assert stopped == [seat for seat, _ in seats[1:]]     # its other work stopped
        assert connection.detached == call_seats.MAX_DETACHED + 1 and connection.ended
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


def test_a_stream_ended_for_room_mid_answer_starts_no_more_work():
    """rev27o O-1: a stream ended for room while its write waited (a client with its
    window shut, answered a refusal) was detached but went on reading its client and
    calling tritonserver outside the cap: one connection put 260 calls at once through a
    cap of 4. Detached, it stops all its work but that write."""
    import h2.config
    import h2.connection
    import h2.settings
    from tritonclient.grpc import service_pb2

    at_triton = {"now": 0, "peak": 0}

    async def slow(requests, context):
        async for raw in requests:
            at_triton["now"] += 1
            at_triton["peak"] = max(at_triton["peak"], at_triton["now"])
            try:
                await asyncio.sleep(2)
            finally:
                at_triton["now"] -= 1
            yield raw

    def framed(model: str) -> bytes:
        message = service_pb2.ModelInferRequest(model_name=model).SerializeToString()
        return b"\x00" + len(message).to_bytes(4, "big") + message

    async def main():
        async with open_door(2, handler=slow, models=frozenset({"ensemble"})) as door:
            host, port = door.address.rsplit(":", 1)
            raw = socket.create_connection((host, int(port)))
            h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            h2c.initiate_connection()
            h2c.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
            streams = []
            for _ in range(2):                     # refused; the answers wait unread
                streams.append(h2c.get_next_available_stream_id())
                h2c.send_headers(streams[-1], [
                    (":method", "POST"), (":scheme", "http"), (":authority", "door"),
                    (":path", f"/{SERVICE}/ModelStreamInfer"),
                    ("content-type", "application/grpc"), ("te", "trailers")])
                h2c.send_data(streams[-1], framed("not-served"))
            raw.sendall(h2c.data_to_send())
            await asyncio.sleep(0.5)
            async with grpc.aio.insecure_channel(door.address) as other:
                calls = [other.stream_stream(STREAM)() for _ in range(2)]
                for call in calls:                     # they take the raw streams' seats
                    await call.write(infer_request(1))
                await asyncio.sleep(0.5)
                for stream in streams:                 # work sent on the detached streams
                    for _ in range(8):
                        h2c.send_data(stream, framed("ensemble"))
                raw.sendall(h2c.data_to_send())
                await asyncio.sleep(1.0)
                assert at_triton["peak"] <= 2          # the two seated calls' alone
                for call in calls:
                    assert await call.read() == infer_request(1)
            raw.close()
    asyncio.run(main())

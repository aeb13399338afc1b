"""The generation decode loop without a server: real ZeroMQ messages (one per step per
orchestrator address), stops reaching their instance, stream_interval, a send that fails,
idle sockets closed, and a stuck loop reporting its stacks."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from triton_disagg.engine.sequence import EngineRequest
from triton_disagg import token_wire
from triton_disagg.errors import ErrorCode
from triton_disagg.generation.decode_loop import DecodeAdmission, DecodeLoop
from triton_disagg.engine.sequence import TokenEvent
from triton_disagg.token_wire import StopInbox, TokenOutbox
from triton_disagg.zmq_endpoints import bind, push_socket


@pytest.fixture(scope="module")
def engine(demo_engine):
    from triton_disagg.engine.llm_engine import LLMEngine

    return LLMEngine(demo_engine, num_blocks=256)


class Orchestrators:
    """Real PULL sockets standing in for orchestrators; collects each message's events."""

    def __init__(self, count: int):
        self.context = zmq.Context.instance()
        self.socks = [self.context.socket(zmq.PULL) for _ in range(count)]
        self.endpoints = [bind(s, None, "tokens") for s in self.socks]

    def address(self, i: int, key: str = "k") -> str:
        """Orchestrator ``i``'s token address for a request with ``key``."""
        return token_wire.with_key(self.endpoints[i].address, key)

    def messages(self, i: int, finals: int, timeout: float = 60.0) -> list[list[TokenEvent]]:
        got, deadline = [], time.monotonic() + timeout
        while sum(e.final for m in got for e in m) < finals:
            assert self.socks[i].poll(max(1, int(1000 * (deadline - time.monotonic())))), got
            got.append(token_wire.decode_events(self.socks[i].recv()))
        return got

    def close(self):
        for sock, endpoint in zip(self.socks, self.endpoints):
            sock.close(linger=0)
            endpoint.release()


def _request(prompt, max_tokens, streaming=True):
    from triton_disagg.engine.sampling import SamplingParams

    return EngineRequest(prompt, SamplingParams(max_tokens=max_tokens), streaming)


def test_one_message_per_step_per_address_and_a_stop_reaches_its_instance(engine):
    side = DecodeAdmission(engine, None)
    orchestrators = Orchestrators(1)
    context = zmq.Context.instance()
    stops = StopInbox(context, None)
    loop = DecodeLoop(engine, TokenOutbox(context), side, stops=stops)
    prompts = {f"r{i}": [5 + i, 6, 7] for i in range(3)}
    for rid, prompt in prompts.items():
        loop.submit(rid, _request(prompt, 8), orchestrators.address(0))
    loop.submit("long", _request([9, 9], 500, False), orchestrators.address(0))
    messages = orchestrators.messages(0, finals=3)
    push = push_socket(context, stops.address, 10)           # the orchestrator's stop
    push.send(token_wire.encode_stop("long", "k"))
    messages += orchestrators.messages(0, finals=1)
    push.close(linger=1000)
    loop.close()
    orchestrators.close()
    assert not stops.endpoint.directory.exists()
    # The three streams share decode steps: each message holds one event per request.
    assert len(messages) <= 8 + 2 and max(len(m) for m in messages) >= 3
    events = [e for m in messages for e in m]
    offline = engine.generate(list(prompts.values()), _request([0], 8).params)
    for (rid, _), seq in zip(prompts.items(), offline):
        mine = [e for e in events if e.request_id == rid]
        assert [t for e in mine for t in e.tokens] == seq.output_ids
        assert [e.final for e in mine].count(True) == 1 and mine[-1].final
        assert all(e.log_probs is None for e in mine)    # none asked for, none sent
    assert [e.finish_reason for e in events if e.request_id == "long"] == ["cancelled"]
    assert engine.pool.num_used == 0


def test_stream_interval_groups_tokens_after_the_first(engine):
    side = DecodeAdmission(engine, None)
    orchestrators = Orchestrators(1)
    loop = DecodeLoop(engine, TokenOutbox(zmq.Context.instance()), side, stream_interval=3)
    loop.submit("r", _request([5, 6, 7], 9), orchestrators.address(0))
    events = [e for m in orchestrators.messages(0, finals=1) for e in m]
    loop.close()
    orchestrators.close()
    # 9 tokens: the first at once, then groups of 3, the last 2 with the final event.
    assert [len(e.tokens) for e in events] == [1, 3, 3, 2]
    assert [e.final for e in events] == [False, False, False, True]
    offline = engine.generate([[5, 6, 7]], _request([0], 9).params)[0].output_ids
    assert [t for e in events for t in e.tokens] == offline and engine.pool.num_used == 0


class BrokenSocket:
    def send(self, frame, flags=0):
        raise RuntimeError("send failed")

    def close(self, linger=0):
        pass


def test_the_loop_survives_a_send_that_raises(engine):
    """Requests for an address whose send raises fail; the loop goes on and the requests
    of another address finish with every token."""
    side = DecodeAdmission(engine, None)
    orchestrators = Orchestrators(1)
    outbox = TokenOutbox(zmq.Context.instance())
    outbox.sockets["ipc:///gone"] = BrokenSocket()
    done: list[str] = []
    side.request_done = done.append
    loop = DecodeLoop(engine, outbox, side)
    loop.submit("doomed", _request([5, 6], 400), "ipc:///gone#k")
    loop.submit("fine", _request([5, 7], 12), orchestrators.address(0))
    events = [e for m in orchestrators.messages(0, finals=1) for e in m]
    loop.submit("later", _request([8], 4), orchestrators.address(0))
    events += [e for m in orchestrators.messages(0, finals=1) for e in m]
    loop.close()
    orchestrators.close()
    assert loop.thread.is_alive() is False and "doomed" not in loop.live
    assert [e.finish_reason for e in events if e.final] == ["length", "length"]
    assert sum(len(e.tokens) for e in events) == 12 + 4
    assert sorted(done) == ["error", "finished", "finished"] and engine.pool.num_used == 0


def test_the_outbox_closes_a_failed_socket_and_idle_ones(monkeypatch):
    orchestrators, outbox = Orchestrators(1), TokenOutbox(zmq.Context.instance())
    outbox.sockets["ipc:///gone"] = BrokenSocket()
    address = orchestrators.endpoints[0].address
    outbox.put("ipc:///gone", TokenEvent("a", [1]))
    outbox.put("ipc:///gone", TokenEvent("e", [], error="x"))
    outbox.put(address, TokenEvent("b", [2]))
    assert outbox.flush() == {"ipc:///gone": [TokenEvent("a", [1])]}   # errors not reported
    assert list(outbox.sockets) == [address]
    assert orchestrators.socks[0].poll(2000)
    assert token_wire.decode_events(orchestrators.socks[0].recv()) == [TokenEvent("b", [2])]
    monkeypatch.setattr(token_wire, "IDLE_SECONDS", 0.0)
    assert outbox.flush() == {} and outbox.sockets == {}        # nothing sent: idle, closed
    outbox.close()
    orchestrators.close()


def test_a_stuck_loop_reports_its_stacks_and_fails_its_requests(engine, capfd):
    side = DecodeAdmission(engine, None)
    orchestrators = Orchestrators(1)
    release = threading.Event()
    step = engine.step

    def stuck_step():
        release.wait(30)
        return step()

    loop = DecodeLoop(engine, TokenOutbox(zmq.Context.instance()), side, stuck_seconds=0.5)
    engine.step = stuck_step
    try:
        loop.submit("r", _request([5, 6], 50), orchestrators.address(0))
        (message,) = orchestrators.messages(0, finals=1, timeout=10)
    finally:
        release.set()
        del engine.step
    assert "stuck" in message[0].error and message[0].request_id == "r"
    deadline = time.monotonic() + 10
    while loop.live and time.monotonic() < deadline:     # the loop came round: it drops "r"
        time.sleep(0.05)
    loop.close()
    orchestrators.close()
    assert not loop.live and engine.pool.num_used == 0
    assert "stuck_step" in capfd.readouterr().err       # every thread's stack was logged


class StallingOutbox(TokenOutbox):
    """An outbox whose sockets to ``address`` can be made to stall as a full socket does:
    ``stall(n)``: the next ``n`` messages are taken but never delivered (queued for a
    peer that does not read), then a send raises ``zmq.Again`` (the high-water mark)."""

    def __init__(self, context, address):
        super().__init__(context)
        self.address, self.swallow = address, None
        self.swallowed: list[list[TokenEvent]] = []

    def stall(self, messages: int) -> None:
        self.swallow = messages

    def _connect(self, address):
        sock = super()._connect(address)
        return StallingSocket(self, sock) if address == self.address else sock


class StallingSocket:
    def __init__(self, outbox: StallingOutbox, sock: zmq.Socket):
        self.outbox, self.sock = outbox, sock

    def send(self, frame, flags=0):
        if self.outbox.swallow is None:
            return self.sock.send(frame, flags)
        if self.outbox.swallow:
            self.outbox.swallow -= 1
            self.outbox.swallowed.append(token_wire.decode_events(frame))
            return None
        self.outbox.swallow = None               # the next socket to it works again
        raise zmq.Again()

    def close(self, linger=0):
        self.sock.close(linger=linger)


def test_a_dropped_token_socket_fails_every_request_that_streams_to_it(engine):
    """Three requests stream to orchestrator 0 (two streaming, one not: it has no event in
    the failed message), one to orchestrator 1. The socket to 0 stalls: two steps' messages
    are lost with it, then a send fails. Every request of orchestrator 0 ends in an error
    (over a fresh socket), none with a normal end and tokens missing; orchestrator 1's
    request is untouched, and every block is free."""
    side = DecodeAdmission(engine, None)
    orchestrators = Orchestrators(2)
    outbox = StallingOutbox(zmq.Context.instance(), orchestrators.endpoints[0].address)
    done: list[str] = []
    side.request_done = done.append
    loop = DecodeLoop(engine, outbox, side)
    for rid, prompt, streaming in (("s1", [5, 6], True), ("s2", [5, 7], True),
                                   ("whole", [5, 8], False)):
        loop.submit(rid, _request(prompt, 200, streaming), orchestrators.address(0))
    loop.submit("other", _request([9, 9], 40), orchestrators.address(1))
    first = orchestrators.socks[0].poll(10_000) and token_wire.decode_events(
        orchestrators.socks[0].recv())
    assert first and {e.request_id for e in first} == {"s1", "s2"}
    outbox.stall(2)
    events = [e for m in orchestrators.messages(0, finals=3) for e in m]
    others = [e for m in orchestrators.messages(1, finals=1) for e in m]
    loop.close()
    orchestrators.close()
    assert len(outbox.swallowed) == 2
    finals = {e.request_id: e for e in events if e.final}
    assert set(finals) == {"s1", "s2", "whole"}
    for rid, event in finals.items():
        assert event.error is not None and "lost the token events" in event.error, (rid, event)
    assert [e.finish_reason for e in others if e.final] == ["length"]
    assert sum(len(e.tokens) for e in others) == 40
    assert sorted(done) == ["error", "error", "error", "finished"]
    assert engine.pool.num_used == 0


def test_a_stop_without_the_requests_key_is_ignored(engine, monkeypatch, caplog):
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.01), step())[1])  # >= 2 s to its end
    side = DecodeAdmission(engine, None)
    orchestrators = Orchestrators(1)
    context = zmq.Context.instance()
    stops = StopInbox(context, None)
    loop = DecodeLoop(engine, TokenOutbox(context), side, stops=stops)
    loop.submit("long", _request([9, 9], 500), orchestrators.address(0, key="right"))
    push = push_socket(context, stops.address, 10)
    assert orchestrators.socks[0].poll(10_000)
    for key in ("wrong", ""):                             # a stranger's stops
        push.send(token_wire.encode_stop("long", key))
    deadline = time.monotonic() + 5
    while loop.dropped.counts["bad_key"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "long" in loop.live                            # both handled, still generating
    push.send(token_wire.encode_stop("long", "right"))
    events = [e for m in orchestrators.messages(0, finals=1) for e in m]
    push.close(linger=1000)
    loop.close()
    orchestrators.close()
    assert [e.finish_reason for e in events if e.final] == ["cancelled"]
    assert [e.seq for e in events] == list(range(len(events)))     # numbered 0, 1, 2, ...
    assert engine.pool.num_used == 0


def test_token_sockets_stay_bounded_under_many_distinct_addresses(engine):
    """Many one-shot addresses (one request each) leave at most ``max_sockets`` sockets
    open; with every socket's address busy, a request for one more is refused with an
    error that says why, UNAVAILABLE."""
    side = DecodeAdmission(engine, None)
    outbox = TokenOutbox(zmq.Context.instance(), max_sockets=2)
    orchestrators = Orchestrators(3)
    loop = DecodeLoop(engine, outbox, side)
    for i in range(12):
        loop.submit(f"one-{i}", _request([5], 1),
                    token_wire.with_key(f"ipc:///nowhere/orchestrator-{i}", "k"))
    deadline = time.monotonic() + 10
    while (loop.live or not loop.inbox.empty()) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)                                       # the loop's last flush
    assert len(outbox.sockets) <= 2
    for i in (0, 1):
        loop.submit(f"busy-{i}", _request([5, i], 300, False), orchestrators.address(i))
    time.sleep(0.3)
    loop.submit("more", _request([7], 4), orchestrators.address(2))
    (refused,) = [e for m in orchestrators.messages(2, finals=1) for e in m]
    for i in (0, 1):
        orchestrators.messages(i, finals=1)
    loop.close()
    orchestrators.close()
    assert "at most 2 orchestrator addresses" in refused.error
    assert refused.code is ErrorCode.UNAVAILABLE          # over ZeroMQ: a 503, not a fault
    assert engine.pool.num_used == 0


def test_a_dead_orchestrators_requests_are_aborted_and_their_kv_freed(engine):
    """The orchestrator closes its token socket (it died) while its non-streaming request
    decodes (no event on the way, so no send fails): the loop sees the disconnection,
    aborts the request and frees its blocks instead of decoding to its end."""
    side = DecodeAdmission(engine, None)
    orchestrators = Orchestrators(1)
    done: list[str] = []
    side.request_done = done.append
    loop = DecodeLoop(engine, TokenOutbox(zmq.Context.instance()), side)
    loop.submit("earlier", _request([5], 2), orchestrators.address(0))
    orchestrators.messages(0, finals=1)                   # the socket to it is connected
    loop.submit("orphan", _request([5, 6], 500, False), orchestrators.address(0))
    time.sleep(0.05)
    orchestrators.close()
    deadline = time.monotonic() + 5
    while loop.live and time.monotonic() < deadline:
        time.sleep(0.01)
    live = dict(loop.live)
    loop.close()
    assert live == {} and done == ["finished", "error"] and engine.pool.num_used == 0

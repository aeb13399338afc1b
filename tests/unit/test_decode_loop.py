"""The generation decode loop without a server: real ZeroMQ messages (one per step per
orchestrator address), stops reaching their instance, stream_interval, a send that fails,
idle sockets closed, and a stuck loop reporting its stacks."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from triton_disagg import protocol as P
from triton_disagg.triton import engine_request
from triton_disagg import token_wire
from triton_disagg.generation.decode_loop import DecodeLoop
from triton_disagg.generation.side import GenerationSide
from triton_disagg.generation.sockets import StopInbox, TokenOutbox
from triton_disagg.token_wire import StreamEvent
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

    def address(self, i: int) -> str:
        return self.endpoints[i].address

    def messages(self, i: int, finals: int, timeout: float = 60.0) -> list[list[StreamEvent]]:
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

    return engine_request.EngineRequest(prompt, SamplingParams(max_tokens=max_tokens), streaming)


def test_one_message_per_step_per_address_and_a_stop_reaches_its_instance(engine):
    side = GenerationSide(engine, None)
    orchestrators = Orchestrators(1)
    context = zmq.Context.instance()
    stops = StopInbox(context, None)
    loop = DecodeLoop(engine, TokenOutbox(context), side, stops=stops)
    prompts = {f"r{i}": [5 + i, 6, 7] for i in range(3)}
    for rid, prompt in prompts.items():
        loop.submit(rid, side.prepare(P.CONTEXT_AND_GENERATION, _request(prompt, 8), {}),
                    orchestrators.address(0))
    loop.submit("long", side.prepare(P.CONTEXT_AND_GENERATION, _request([9, 9], 500, False), {}),
                orchestrators.address(0))
    messages = orchestrators.messages(0, finals=3)
    push = push_socket(context, stops.address, 10)           # the orchestrator's stop
    push.send(token_wire.encode_stop("long"))
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
    side = GenerationSide(engine, None)
    orchestrators = Orchestrators(1)
    loop = DecodeLoop(engine, TokenOutbox(zmq.Context.instance()), side, stream_interval=3)
    loop.submit("r", side.prepare(P.CONTEXT_AND_GENERATION, _request([5, 6, 7], 9), {}),
                orchestrators.address(0))
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
    side = GenerationSide(engine, None)
    orchestrators = Orchestrators(1)
    outbox = TokenOutbox(zmq.Context.instance())
    outbox.sockets["ipc:///gone"] = BrokenSocket()
    done: list[str] = []
    side.request_done = done.append
    loop = DecodeLoop(engine, outbox, side)
    loop.submit("doomed", side.prepare(P.CONTEXT_AND_GENERATION, _request([5, 6], 400), {}),
                "ipc:///gone")
    loop.submit("fine", side.prepare(P.CONTEXT_AND_GENERATION, _request([5, 7], 12), {}),
                orchestrators.address(0))
    events = [e for m in orchestrators.messages(0, finals=1) for e in m]
    loop.submit("later", side.prepare(P.CONTEXT_AND_GENERATION, _request([8], 4), {}),
                orchestrators.address(0))
    events += [e for m in orchestrators.messages(0, finals=1) for e in m]
    loop.close()
    orchestrators.close()
    assert loop.thread.is_alive() is False and "doomed" not in loop.live
    assert [e.finish_reason for e in events if e.final] == ["length", "length"]
    assert sum(len(e.tokens) for e in events) == 12 + 4
    assert sorted(done) == ["error", "finished", "finished"] and engine.pool.num_used == 0


def test_the_outbox_closes_a_failed_socket_and_idle_ones(monkeypatch):
    from triton_disagg.generation import sockets as generation_sockets

    orchestrators, outbox = Orchestrators(1), TokenOutbox(zmq.Context.instance())
    outbox.sockets["ipc:///gone"] = BrokenSocket()
    outbox.put("ipc:///gone", StreamEvent("a", [1]))
    outbox.put(orchestrators.address(0), StreamEvent("b", [2]))
    assert outbox.flush() == ["a"] and list(outbox.sockets) == [orchestrators.address(0)]
    assert orchestrators.socks[0].poll(2000)
    assert token_wire.decode_events(orchestrators.socks[0].recv()) == [StreamEvent("b", [2])]
    monkeypatch.setattr(generation_sockets, "IDLE_SECONDS", 0.0)
    assert outbox.flush() == [] and outbox.sockets == {}        # nothing sent: idle, closed
    outbox.close()
    orchestrators.close()


def test_a_stuck_loop_reports_its_stacks_and_fails_its_requests(engine, capfd):
    side = GenerationSide(engine, None)
    orchestrators = Orchestrators(1)
    release = threading.Event()
    step = engine.step

    def stuck_step():
        release.wait(30)
        return step()

    loop = DecodeLoop(engine, TokenOutbox(zmq.Context.instance()), side, stuck_seconds=0.5)
    engine.step = stuck_step
    try:
        loop.submit("r", side.prepare(P.CONTEXT_AND_GENERATION, _request([5, 6], 50), {}),
                    orchestrators.address(0))
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

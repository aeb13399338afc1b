"""Readers that cannot die: the real token inbox and stop inbox fed hostile frames over
real ZeroMQ sockets (each dropped, counted in ``disagg_dropped_frames_total``, and a valid
frame still gets through), a non-ASCII key beside a valid stop in one pass, and a reader
that dies anyway taking its instance down."""

from __future__ import annotations

import asyncio
import logging
import time

import msgpack
import pytest
import zmq

from triton_disagg import readers, token_wire
from triton_disagg.front.token_inbox import TokenInbox
from triton_disagg.engine.sequence import TokenEvent
from triton_disagg.token_wire import StopInbox
from triton_disagg.triton.metrics import Metrics
from triton_disagg.zmq_endpoints import bind, push_socket

WAIT_S = 10.0


def hostile_frames(request_id: str) -> list[bytes]:
    """One of each kind of malformed token frame, all for ``request_id``."""
    event = {"request_id": request_id, "key": "k", "seq": 0, "tokens": [1]}
    return [b"\xc1 not msgpack", b"", msgpack.packb([1, 2]),                # bad msgpack, type
            msgpack.packb({"v": 1, "events": [event]}),                      # wrong version
            msgpack.packb({"v": 3, "events": "x" * 10}),                     # wrong type
            msgpack.packb({"v": 3, "events": [{**event, "key": "schl\u00fcssel"}]}),  # key
            msgpack.packb({"v": 3, "events": [{**event, "tokens": [1.5]}]}),  # wrong type
            msgpack.packb({"v": 3, "events": [{**event, "seq": "0"}]}),
            msgpack.packb({"v": 3, "events": [{**event, "request_id": 7}]})]


class FakeFamily:
    """``pb_utils.MetricFamily`` as the metrics writer uses it: each series' value."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    series: dict[tuple, list] = {}

    def __init__(self, name: str, description: str, kind: str):
        self.name = name

    def Metric(self, labels: dict, **kwargs):
        value = FakeFamily.series.setdefault((self.name, tuple(sorted(labels.items()))), [0])

        class Series:
            def increment(self, n):
                value[0] += n
            set = observe = increment
        return Series()


class FakePbUtils:
    MetricFamily = FakeFamily


@pytest.fixture
def metrics():
    """A real :class:`Metrics` over a fake ``pb_utils``, receiving every reader's drops;
    returns ``count(reader, reason)`` (read after the writer applied the updates)."""
    FakeFamily.series = {}
    m = Metrics(FakePbUtils, "test", "test_0_0")
    readers.report_to(m)

    def count(reader: str, reason: str) -> int:
        m.close()
        labels = {"role": "test", "model_instance": "test_0_0", "reader": reader,
                  "reason": reason}
        return FakeFamily.series.get(("disagg_dropped_frames_total",
                                      tuple(sorted(labels.items()))), [0])[0]
    yield count
    readers.report_to(None)
    m.close()


def test_the_token_reader_survives_hostile_frames_and_a_valid_event_still_arrives(metrics):
    deaths = []

    async def main():
        inbox = TokenInbox(None, WAIT_S, on_death=lambda *a: deaths.append(a))
        with inbox.open("r") as stream:
            hostile = push_socket(zmq.Context.instance(), inbox.address, 100)
            oversized = push_socket(zmq.Context.instance(), inbox.address, 10)
            oversized.send(b"\x00" * (token_wire.MAX_TOKEN_FRAME_BYTES + 1))  # never read
            frames = hostile_frames("r")
            for frame in frames:
                hostile.send(frame)
            hostile.send(token_wire.encode_events([TokenEvent("r", [9], seq=0,
                                                               key="wr\u00f6ng")]))  # non-ASCII
            hostile.send(token_wire.encode_events([TokenEvent("r", [9], seq=0, key="wrong")]))
            hostile.send(token_wire.encode_events([TokenEvent("nobody", [9], seq=0, key="k")]))
            hostile.send(token_wire.encode_events([TokenEvent("r", [5], seq=0,
                                                               key=stream.key)]))
            event = await asyncio.wait_for(stream.next(), WAIT_S)
            hostile.close(linger=0)
            oversized.close(linger=0)
        assert event.tokens == [5] and not inbox.reader.done()
        inbox.close()
        return len(frames) + 1
    malformed = asyncio.run(main())
    assert deaths == []
    reader = "orchestrator token inbox"
    assert metrics(reader, readers.MALFORMED) == malformed
    assert metrics(reader, readers.BAD_KEY) == 1
    assert metrics(reader, readers.UNKNOWN_REQUEST) == 1


def test_the_stop_inbox_survives_hostile_frames_and_a_valid_stop_still_gets_through(metrics):
    context = zmq.Context.instance()
    stops = StopInbox(context, None)
    hostile = push_socket(context, stops.address, 100)
    frames = [b"\xc1", b"", msgpack.packb({"v": 3}), msgpack.packb({"v": 3, "stop": "r"}),
              msgpack.packb({"v": 3, "stop": 5, "key": "k"}),
              msgpack.packb({"v": 3, "stop": "r", "key": "cl\u00e9"}),      # non-ASCII key
              msgpack.packb({"v": 3, "stop": "r", "key": b"k"})]
    for frame in frames:
        hostile.send(frame)
    hostile.send(token_wire.encode_stop("r", "k" * 65))                    # too long a key
    oversized = push_socket(context, stops.address, 10)
    oversized.send(b"\x00" * (token_wire.MAX_STOP_FRAME_BYTES + 1))       # never read
    hostile.send(token_wire.encode_stop("r", "right"))
    taken, deadline = [], time.monotonic() + WAIT_S
    while not taken and time.monotonic() < deadline:
        taken = stops.take()
        time.sleep(0.01)
    hostile.close(linger=0)
    oversized.close(linger=0)
    stops.close()
    assert taken == [("r", "right")]
    assert stops.dropped.counts == {readers.MALFORMED: len(frames) + 1}
    assert metrics("generation stop inbox", readers.MALFORMED) == len(frames) + 1


class OneTake:
    """The control socket as the loop sees it: ``stops`` in the first take, then none."""

    def __init__(self, stops: list[tuple[str, str]]):
        self.stops = stops

    def take(self) -> list[tuple[str, str]]:
        stops, self.stops = self.stops, []
        return stops

    def close(self) -> None:
        pass


def test_a_non_ascii_key_beside_a_valid_stop_in_one_pass_is_dropped_and_the_stop_obeyed(
        demo_engine):
    from triton_disagg.engine.llm_engine import LLMEngine
    from triton_disagg.engine.sampling import SamplingParams
    from triton_disagg.generation.decode_loop import DecodeAdmission, DecodeLoop
    from triton_disagg.token_wire import TokenOutbox
    from triton_disagg.engine.sequence import EngineRequest

    engine = LLMEngine(demo_engine, num_blocks=64)
    side, context = DecodeAdmission(engine, None), zmq.Context.instance()
    orchestrator = context.socket(zmq.PULL)
    endpoint = bind(orchestrator, None, "tokens")
    stops = OneTake([])
    loop = DecodeLoop(engine, TokenOutbox(context), side, stops=stops)
    long = EngineRequest([9, 9], SamplingParams(max_tokens=500), True)
    loop.submit("long", long, token_wire.with_key(endpoint.address, "right"))
    assert orchestrator.poll(10_000)                             # it generates
    stops.stops = [("long", "r\u00e9ght"), ("gone", "k"), ("long", "right")]
    finals, deadline = [], time.monotonic() + WAIT_S
    while not finals and orchestrator.poll(max(1, int(1000 * (deadline - time.monotonic())))):
        finals = [e for e in token_wire.decode_events(orchestrator.recv()) if e.final]
    loop.close()
    orchestrator.close(linger=0)
    endpoint.release()
    assert [e.finish_reason for e in finals] == ["cancelled"]
    assert loop.dropped.counts == {readers.BAD_KEY: 1, readers.UNKNOWN_REQUEST: 1}
    assert engine.pool.num_used == 0


# ---- a reader that dies anyway ------------------------------------------------------------

def test_a_token_reader_that_dies_takes_its_instance_down(monkeypatch):
    from triton_disagg.front.token_inbox import TokenStream

    def broken(self, event):
        raise RuntimeError("a bug in the reader")
    monkeypatch.setattr(TokenStream, "deliver", broken)
    deaths = []

    async def main():
        inbox = TokenInbox(None, WAIT_S, on_death=lambda *a: deaths.append(a))
        with inbox.open("r") as stream:
            push = push_socket(zmq.Context.instance(), inbox.address, 10)
            push.send(token_wire.encode_events([TokenEvent("r", [5], key=stream.key)]))
            deadline = time.monotonic() + WAIT_S
            while not deaths and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            push.close(linger=0)
        inbox.close()
    asyncio.run(main())
    assert [(reader, str(exc)) for reader, exc in deaths] == [
        ("orchestrator token reader", "a bug in the reader")]


def test_a_decode_loop_that_dies_takes_its_instance_down(demo_engine, monkeypatch):
    from triton_disagg.engine.llm_engine import LLMEngine
    from triton_disagg.generation.decode_loop import DecodeAdmission, DecodeLoop
    from triton_disagg.token_wire import TokenOutbox

    engine = LLMEngine(demo_engine, num_blocks=16)
    outbox = TokenOutbox(zmq.Context.instance())
    monkeypatch.setattr(outbox, "flush", lambda keep=(): 1 / 0)   # outside an iteration's try
    deaths = []
    loop = DecodeLoop(engine, outbox, DecodeAdmission(engine, None),
                      on_death=lambda *a: deaths.append(a))
    loop.thread.join(WAIT_S)
    assert not loop.thread.is_alive()
    assert [(reader, type(exc)) for reader, exc in deaths] == [
        ("generation decode loop", ZeroDivisionError)]


def test_fail_instance_says_why_and_exits_the_process(monkeypatch, caplog):
    exits = []
    monkeypatch.setattr(readers.os, "_exit", exits.append)
    with caplog.at_level(logging.CRITICAL, logger="triton_disagg.readers"):
        readers.fail_instance("orchestrator token reader", TypeError("non-ASCII"))
    assert exits == [readers.EXIT_READER_DIED]
    assert "orchestrator token reader died (TypeError: non-ASCII)" in caplog.text
    assert "serve restarts the server" in caplog.text


def test_dropped_frames_are_logged_once_per_window_and_counted_each(caplog):
    now = [0.0]
    dropped = readers.DroppedFrames("test reader", clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="triton_disagg.readers"):
        for _ in range(5):
            dropped.drop(readers.MALFORMED, "garbage")
        now[0] = readers.LOG_EVERY_SECONDS
        dropped.drop(readers.MALFORMED, "garbage")
    lines = [r.getMessage() for r in caplog.records]
    assert dropped.counts == {readers.MALFORMED: 6}
    assert len(lines) == 2 and "dropped 1 frame(s)" in lines[0] and "dropped 5" in lines[1]


def test_updates_taken_before_close_are_applied_even_when_the_writer_is_busy(metrics):
    """``Metrics.close`` applies what it took before: the count a reader reads right after
    its drops is whole even when the writer thread is still busy (before, every update still
    queued at close was ignored: this file's counts read 0 under load)."""
    m = Metrics(FakePbUtils, "test", "test_0_0")
    m._later(lambda: time.sleep(0.05))           # the writer is busy when the drops arrive
    for _ in range(10):
        m.dropped_frame("orchestrator token inbox", readers.MALFORMED)
    m.close()
    labels = {"role": "test", "model_instance": "test_0_0",
              "reader": "orchestrator token inbox", "reason": readers.MALFORMED}
    assert FakeFamily.series[("disagg_dropped_frames_total",
                              tuple(sorted(labels.items())))] == [10]
    m.dropped_frame("orchestrator token inbox", readers.MALFORMED)    # after close: ignored
    assert FakeFamily.series[("disagg_dropped_frames_total",
                              tuple(sorted(labels.items())))] == [10]

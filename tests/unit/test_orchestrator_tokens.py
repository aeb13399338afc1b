"""The orchestrator's token stream without a server, over real ipc sockets: tokens arrive
over ZeroMQ and are detokenized, queued events merge, a silent stream ends in an error, a
spoofed event is ignored, a sequence gap fails the request, idle stop sockets close."""

from __future__ import annotations

import asyncio
import time

import pytest

from orchestrator_fakes import FakeGeneration, serve_one
from triton_disagg import protocol as P
from triton_disagg.errors import EngineError, ErrorCode, Timeout
from triton_disagg.front.token_inbox import TokenInbox
from triton_disagg.engine.sequence import TokenEvent


def test_tokens_arrive_over_zeromq_and_are_detokenized():
    generation, texts = FakeGeneration(10, [11, 12, 1]), []

    async def send(outputs, final):
        texts.append((outputs["text_output"][0], final))

    assert serve_one(generation, send) == "finished"
    # the first token at once; the rest as they came, or merged where they queued
    assert texts[0] == ("\u4e0a", False) and texts[-1][1] and not any(f for _, f in texts[:-1])
    assert "".join(t for t, _ in texts) == "\u4e0a\u4e0b\u4e0c"
    assert generation.calls == [(P.GENERATION_ONLY, [3, 4, 10])]   # prompt + first token
    assert generation.stops(timeout_ms=200) == []        # generation ended it: no stop
    generation.close()


def test_events_that_queued_are_taken_as_one_but_an_error_comes_on_its_own():
    from triton_disagg.front.token_inbox import TokenStream

    async def main():
        stream = TokenStream(TokenInbox(None, 1.0), "r")
        lp = [-0.1]
        for event in (TokenEvent("r", [5], lp), TokenEvent("r", [6], lp),
                      TokenEvent("r", [7, 8], lp * 2, finish_reason="length")):
            stream.events.put_nowait(event)
        merged = await stream.next()
        assert merged == TokenEvent("r", [5, 6, 7, 8], lp * 4, "length") and stream.ended
        stream = TokenStream(TokenInbox(None, 1.0), "c")   # a stop's final event: no tokens,
        for event in (TokenEvent("c", [5], lp), TokenEvent("c", [], finish_reason="cancelled")):
            stream.events.put_nowait(event)                # so no log-probs to join
        assert await stream.next() == TokenEvent("c", [5], lp, "cancelled")
        stream = TokenStream(TokenInbox(None, 1.0), "s")
        for event in (TokenEvent("s", [5]), TokenEvent("s", [6]),
                      TokenEvent("s", [], error="boom"), TokenEvent("s", [9])):
            stream.events.put_nowait(event)
        assert await stream.next() == TokenEvent("s", [5, 6]) and not stream.ended
        with pytest.raises(EngineError, match="boom"):
            await stream.next()
        assert stream.ended
    asyncio.run(main())


def test_a_silent_stream_ends_in_a_clear_error_and_stops_generation():
    generation = FakeGeneration(10, [11, 1], silent=True)

    async def send(outputs, final):
        pass

    started = time.monotonic()
    result = serve_one(generation, send, stall=0.3)
    assert isinstance(result, Timeout) and "stall_seconds" in str(result)
    assert result.status is ErrorCode.TIMEOUT               # the HTTP front's 504
    assert time.monotonic() - started < 5
    assert generation.stops() == generation.request_ids
    generation.close()


def test_a_request_lost_more_often_than_max_migrations_ends_in_one_clear_error():
    from triton_disagg.front.orchestrator import MAX_MIGRATIONS

    generation = FakeGeneration(10, [11, 12, 13, 14, 15, 1], dying=MAX_MIGRATIONS + 1,
                                dies_after=1)

    async def send(outputs, final):
        pass

    result = serve_one(generation, send)
    assert isinstance(result, EngineError) and "\n" not in str(result)
    assert f"generation server gen-{MAX_MIGRATIONS} was lost" in str(result), result
    assert len(generation.calls) == MAX_MIGRATIONS + 1
    generation.close()


def test_a_timeout_after_a_move_stays_a_timeout():
    """gen-0 is lost, the request moves, gen-1 stays silent past the stall: the error says
    why it moved and keeps its code (TIMEOUT: the front's 504), not UNAVAILABLE."""
    generation = FakeGeneration(10, [11, 1], silent=True, dying=1)

    async def send(outputs, final):
        pass

    result = serve_one(generation, send, stall=1.5)
    assert isinstance(result, Timeout) and result.status is ErrorCode.TIMEOUT, result
    assert "generation server gen-0 was lost" in str(result), result
    assert len(generation.calls) == 2
    generation.close()


# ---- the stream's key and sequence -------------------------------------------------------

def test_a_spoofed_event_is_ignored_and_the_real_stream_completes():
    """Before each real event a stranger who knows the request id (but not its key) pushes
    a token and an end: both are dropped, the client gets every real token."""
    generation, texts = FakeGeneration(10, [11, 12, 13, 1], spoof=True), []

    async def send(outputs, final):
        texts.append((outputs["text_output"][0], final))

    assert serve_one(generation, send) == "finished"
    assert "".join(t for t, _ in texts) == "".join(chr(0x4E00 + i) for i in (10, 11, 12, 13))
    assert [f for _, f in texts].count(True) == 1 and texts[-1][1]
    generation.close()


def test_a_gap_in_the_sequence_fails_the_request_and_stops_generation():
    """Event 1 of 4 is lost on the way: the request ends in an error naming the gap, never
    a normal end with a token missing, and generation is told to stop."""
    generation, texts = FakeGeneration(10, [11, 12, 13, 1], skip_seq=1), []

    async def send(outputs, final):
        texts.append(outputs["text_output"][0])

    result = serve_one(generation, send)
    assert isinstance(result, EngineError), result
    assert "were lost" in str(result) and "expected event 1, got 2" in str(result)
    assert "".join(texts) == "".join(chr(0x4E00 + i) for i in (10, 11))   # none after the gap
    assert generation.stops() == generation.request_ids
    generation.close()


def test_stop_sockets_no_stream_names_are_closed_once_idle(monkeypatch):
    """A generation instance restarts with a new control address: the old stop socket
    (dialling a dead address) is closed once idle, the one an open stream names is kept."""
    from triton_disagg.front import token_inbox

    monkeypatch.setattr(token_inbox, "STOP_IDLE_SECONDS", 0.0)

    async def main():
        inbox = TokenInbox(None, 1.0)
        with inbox.open("new") as new:
            new.control = "ipc:///nowhere/new-control"
            inbox.stop(new.control, "earlier", "its key")    # a stop socket to the new one
            with inbox.open("old") as old:                 # exits: stops, then prunes
                old.control = "ipc:///nowhere/old-control"
            assert list(inbox.stop_sockets) == [new.control]
        assert inbox.stop_sockets == {}
        inbox.close()
    asyncio.run(main())

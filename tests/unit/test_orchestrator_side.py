"""The orchestrator's side of the token path without a server, over real ipc sockets: a
real TokenInbox (stall, stop on early exit, merged events), busy contexts retried, KV
given back, and migration off a lost generation server; context and generation are a
fake transport (:class:`FakeGeneration`) that pushes real token frames."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import zmq

from triton_disagg import protocol as P
from triton_disagg.triton import engine_request
from triton_disagg import token_wire
from triton_disagg.errors import ContextBusy, EngineError, GenerationLost
from triton_disagg.front.orchestrator import Orchestrator
from triton_disagg.front.token_inbox import TokenInbox
from triton_disagg.token_wire import StreamEvent
from triton_disagg.zmq_endpoints import bind, push_socket


class FakeGeneration:
    """Context and generation as a transport: generation answers with a real control
    address (a PULL socket the test reads) and pushes its events to the token address.
    Each request's :class:`FakeRoute` passes its calls here with its request id.

    The request's whole output is ``[first] + rest``; a call whose ``input_ids`` already
    hold the prompt (2 tokens) and k of them answers with what follows (context: the next
    token; generation: the rest), so a migrated request resumes where it left off.
    Generation calls go to servers "gen-0", "gen-1", ... in turn; the first ``dying`` of
    them push ``dies_after`` tokens, then fall silent and are lost."""

    def __init__(self, first: int, rest: list[int], silent: bool = False, busy: int = 0,
                 refuse: bool = False, dying: int = 0, dies_after: int = 0,
                 spoof: bool = False, skip_seq: int | None = None, mute_context: bool = False):
        self.first, self.rest, self.silent = first, rest, silent
        self.spoof = spoof          # a stranger who knows the request id pushes events too
        self.skip_seq = skip_seq    # the event numbered this one is lost on the way
        self.mute_context = mute_context          # context calls never answer
        self.timeouts: list[float] = []           # each route's deadline per call
        self.busy, self.refuse = busy, refuse       # context busy this many times; refuse all
        self.dying, self.dies_after = dying, dies_after
        self.output_lens: list[int] = []          # each generation call's request_output_len
        self.avoided: list[frozenset] = []        # each route's servers to avoid
        self.released: list[bytes] = []
        self.zmq = zmq.Context.instance()
        self.control = self.zmq.socket(zmq.PULL)
        self.endpoint = bind(self.control, None, "control")
        self.request_ids: list[str] = []
        self.calls: list[tuple[str, list[int]]] = []       # (request_type, input_ids)
        self.contexts = 0                                  # context calls answered
        self.closed: list[str] = []                        # request ids whose route closed

    def route(self, request_id, avoid, timeout):
        self.avoided.append(avoid)
        self.timeouts.append(timeout)
        return FakeRoute(self, request_id)

    async def context(self, request_id, inputs):
        if self.mute_context:
            await asyncio.Event().wait()
        if self.busy:
            self.busy -= 1
            raise ContextBusy(f"{P.CONTEXT_BUSY}: KV cache full")
        self.contexts += 1
        output, done = [self.first] + self.rest, len(inputs["input_ids"]) - 2
        last = "length" if done == len(output) - 1 else ""
        out = engine_request.outputs([output[done]], [-0.5], -0.5, last)
        out[P.CONTEXT_PHASE_PARAMS] = np.frombuffer(b"handle", np.uint8)
        return out

    async def generate(self, request_id, inputs, request_type, token_address) -> str:
        """Generation's answer; the server it went to: ``gen-<n>`` for the n-th call."""
        self.request_ids.append(request_id)
        self.calls.append((request_type, inputs["input_ids"].tolist()))
        self.output_lens.append(int(inputs["request_output_len"][0]))
        if self.refuse:
            raise EngineError("generation refused it")
        server = len(self.calls) - 1
        output = ([self.first] + self.rest)[max(1, len(inputs["input_ids"]) - 2):]
        if server < self.dying:
            output = output[:self.dies_after]
        if not self.silent:
            threading.Thread(target=self._push, args=(request_id, token_address, output,
                                                      server >= self.dying)).start()
        return self.endpoint.address

    def lost(self, server: int):
        return GenerationLost(f"gen-{server}", "probe refused") if server < self.dying else None

    def _push(self, request_id, token_address, output, ends, gap=0.01):
        """One event per decode step, ``gap`` seconds apart, as a decode loop sends them;
        the last final when the server ``ends`` the request (it is not lost first)."""
        address, key = token_wire.split_key(token_address)
        push = push_socket(self.zmq, address, 100)
        for i, token in enumerate(output):
            reason = "stop" if ends and i == len(output) - 1 else None
            if self.spoof:      # right id and sequence, a guessed key: a token, then an end
                push.send(token_wire.encode_events([
                    StreamEvent(request_id, [99], seq=i, key="guess"),
                    StreamEvent(request_id, [], finish_reason="stop", seq=i, key="")]))
            if i != self.skip_seq:
                push.send(token_wire.encode_events([StreamEvent(
                    request_id, [token], finish_reason=reason, seq=i, key=key)]))
            time.sleep(gap)
        push.close(linger=1000)

    async def release(self, request_id, inputs, handle):
        self.released.append(handle.tobytes())

    def stops(self, timeout_ms: int = 2000) -> list[str]:
        got = []
        while self.control.poll(timeout_ms):
            got.append(token_wire.decode_stop(self.control.recv())[0])
            timeout_ms = 100
        return got

    def close(self):
        self.control.close(linger=0)
        self.endpoint.release()


class FakeRoute:
    def __init__(self, fake: FakeGeneration, request_id: str):
        self.fake, self.request_id = fake, request_id
        self.server: int | None = None          # the generation call's server, once made

    async def context(self, inputs):
        return await self.fake.context(self.request_id, inputs)

    async def generate(self, inputs, request_type, token_address):
        address = await self.fake.generate(self.request_id, inputs, request_type, token_address)
        self.server = len(self.fake.calls) - 1
        return address

    async def lost(self):
        return None if self.server is None else self.fake.lost(self.server)

    async def release(self, inputs, handle):
        await self.fake.release(self.request_id, inputs, handle)

    def close(self):
        self.fake.closed.append(self.request_id)


def _run(generation, send, stall=5.0, cancel=lambda: False, cancel_task_after=None,
         mode="disaggregated", stream=True, local_prefill=0):
    """Serve one request through a real TokenInbox; returns the outcome or the exception."""
    decode = lambda ids: "".join(chr(0x4E00 + i) for i in ids)   # noqa: E731 - one char per id

    async def main():
        inbox = TokenInbox(None, stall)
        orchestrator = Orchestrator(generation, inbox, mode, decode, local_prefill=local_prefill)
        inputs = {"input_ids": np.array([3, 4], np.int32), "end_id": np.array([1], np.int32),
                  "stream": np.array([stream]), "request_output_len": np.array([16], np.int32)}
        task = asyncio.ensure_future(orchestrator.handle(inputs, send, cancel))
        if cancel_task_after is not None:
            await asyncio.sleep(cancel_task_after)
            task.cancel()
        try:
            return await task
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            return exc
        finally:
            directory = inbox.endpoint.directory if inbox.endpoint else None
            inbox.close()
            assert directory is None or not directory.exists()   # the ipc file is gone
    return asyncio.run(main())


def test_tokens_arrive_over_zeromq_and_are_detokenized():
    generation, texts = FakeGeneration(10, [11, 12, 1]), []

    async def send(outputs, final):
        texts.append((outputs["text_output"][0], final))

    assert _run(generation, send) == "finished"
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
        for event in (StreamEvent("r", [5], lp, -0.1), StreamEvent("r", [6], lp, -0.2),
                      StreamEvent("r", [7, 8], lp * 2, -0.4, finish_reason="length")):
            stream.events.put_nowait(event)
        merged = await stream.next()
        assert merged == StreamEvent("r", [5, 6, 7, 8], lp * 4, -0.4, "length") and stream.ended
        stream = TokenStream(TokenInbox(None, 1.0), "s")
        for event in (StreamEvent("s", [5]), StreamEvent("s", [6]),
                      StreamEvent("s", [], error="boom"), StreamEvent("s", [9])):
            stream.events.put_nowait(event)
        assert await stream.next() == StreamEvent("s", [5, 6]) and not stream.ended
        with pytest.raises(EngineError, match="boom"):
            await stream.next()
        assert stream.ended
    asyncio.run(main())


def test_non_streaming_first_token_only_and_aggregated():
    sends = []

    async def send(outputs, final):
        sends.append((outputs["text_output"][0], outputs["num_output_tokens"][0], final))

    generation = FakeGeneration(10, [11, 12, 1])
    assert _run(generation, send, stream=False) == "finished"
    assert sends == [("\u4e0a\u4e0b\u4e0c", 3, True)]            # exactly one response
    sends.clear()
    first_only = FakeGeneration(10, [])
    assert _run(first_only, send) == "finished" and first_only.calls == []
    assert sends == [("\u4e0a", 1, True)]
    aggregated = FakeGeneration(10, [11, 1])
    assert _run(aggregated, send, mode="aggregated") == "finished"
    assert aggregated.calls == [(P.CONTEXT_AND_GENERATION, [3, 4])]
    for fake in (generation, first_only, aggregated):
        assert len(fake.closed) == 1          # every request's route closed, once
        fake.close()


@pytest.mark.parametrize("local_prefill, whole", [(0, False), (1, False), (2, True), (9, True)])
def test_a_prompt_at_or_under_max_local_prefill_length_is_served_whole_by_generation(
        local_prefill, whole):
    """The prompt has 2 tokens: at or under the limit it goes to generation as
    context_and_generation (no context call, no handoff); over it, disaggregated."""
    generation, texts = FakeGeneration(10, [11, 1]), []

    async def send(outputs, final):
        texts.append(outputs["text_output"][0])

    assert _run(generation, send, local_prefill=local_prefill) == "finished"
    if whole:
        assert generation.contexts == 0 and generation.calls == [(P.CONTEXT_AND_GENERATION, [3, 4])]
    else:
        assert generation.contexts == 1 and generation.calls == [(P.GENERATION_ONLY, [3, 4, 10])]
    generation.close()


def test_a_silent_stream_ends_in_a_clear_error_and_stops_generation():
    generation = FakeGeneration(10, [11, 1], silent=True)

    async def send(outputs, final):
        pass

    started = time.monotonic()
    result = _run(generation, send, stall=0.3)
    assert isinstance(result, EngineError) and "stall_seconds" in str(result)
    assert time.monotonic() - started < 5
    assert generation.stops() == generation.request_ids
    generation.close()


def test_a_cancelled_request_stops_waiting_for_a_context_that_says_nothing():
    """Each route's calls have the stall deadline; a client that leaves while the context
    call is out is answered at once (flags only), not when the call ends."""
    generation, sent = FakeGeneration(10, [11, 1], mute_context=True), []
    asked = []

    async def send(outputs, final):
        sent.append((outputs, final))

    def cancel():
        asked.append(time.monotonic())
        return len(asked) >= 3

    started = time.monotonic()
    assert _run(generation, send, stall=30.0, cancel=cancel) == "cancelled"
    assert time.monotonic() - started < 2 and sent == [(None, True)]
    assert generation.timeouts == [30.0] and generation.calls == []
    generation.close()


@pytest.mark.parametrize("how", ["finishes", "cancelled after the first token",
                                 "generation refuses"])
def test_kv_that_generation_never_took_is_given_back(how):
    generation = FakeGeneration(10, [11, 1], refuse=how == "generation refuses")
    sent = []

    async def send(outputs, final):
        sent.append(final)

    result = _run(generation, send, cancel=lambda: how.startswith("cancelled") and len(sent) >= 1)
    expected = {"finishes": "finished", "cancelled after the first token": "cancelled"}
    assert result == expected[how] if how in expected else isinstance(result, EngineError)
    assert generation.released == ([] if how == "finishes" else [b"handle"])
    generation.close()


def test_releases_that_hang_do_not_pile_up(monkeypatch):
    """Past MAX_RELEASES release calls out at once, a request's KV is left to its lease."""
    from triton_disagg.front import orchestrator

    monkeypatch.setattr(orchestrator, "MAX_RELEASES", 2)
    generation = FakeGeneration(10, [11, 1], refuse=True)    # each request's KV to release
    hung = asyncio.Event()

    async def release(request_id, inputs, handle):
        generation.released.append(handle.tobytes())
        await hung.wait()
    generation.release = release

    async def send(outputs, final):
        pass

    async def main():
        inbox = TokenInbox(None, 5.0)
        owner = Orchestrator(generation, inbox, "disaggregated", str)
        inputs = {"input_ids": np.array([3, 4], np.int32),
                  "request_output_len": np.array([16], np.int32)}
        try:
            for _ in range(4):
                with pytest.raises(EngineError):
                    await owner.handle(dict(inputs), send)
                await asyncio.sleep(0)
            return len(owner.releases)
        finally:
            hung.set()
            await asyncio.sleep(0)
            inbox.close()

    assert asyncio.run(main()) == 2 and len(generation.released) == 2
    generation.close()


def test_a_busy_context_is_retried_until_it_has_room_within_stall_seconds():
    sends = []

    async def send(outputs, final):
        sends.append(final)

    generation = FakeGeneration(10, [11, 1], busy=3)
    assert _run(generation, send) == "finished" and generation.busy == 0 and sends[-1]
    swamped = FakeGeneration(10, [11, 1], busy=10**6)
    started = time.monotonic()
    result = _run(swamped, send, stall=0.3)
    assert isinstance(result, ContextBusy) and "retried for 0.3 s" in str(result)
    assert 0.2 < time.monotonic() - started < 3 and swamped.calls == []
    sends.clear()
    cancelled = FakeGeneration(10, [11, 1], busy=10**6)
    assert _run(cancelled, send, cancel=lambda: True) == "cancelled" and sends == [True]
    for fake in (generation, swamped, cancelled):
        fake.close()


@pytest.mark.parametrize("how", ["send fails", "client cancels", "task cancelled"])
def test_leaving_a_request_early_stops_generation(how, monkeypatch):
    from triton_disagg.front import orchestrator

    monkeypatch.setattr(orchestrator, "CANCEL_POLL_SECONDS", 0.0)   # ask at every event
    generation = FakeGeneration(10, [11, 12, 13, 14, 1], silent=how == "task cancelled")
    sent = []

    async def send(outputs, final):
        sent.append(final)
        if how == "send fails" and len(sent) == 2:
            raise RuntimeError("the client went away")

    result = _run(generation, send, cancel=lambda: how == "client cancels" and len(sent) >= 2,
                  cancel_task_after=0.3 if how == "task cancelled" else None)
    expected = {"send fails": RuntimeError, "task cancelled": asyncio.CancelledError}
    if how in expected:
        assert isinstance(result, expected[how]), result
    else:
        assert result == "cancelled" and sent[-1] is True
    assert generation.stops() == generation.request_ids
    generation.close()


# ---- migration off a lost generation server ----------------------------------------------

@pytest.mark.parametrize("dies_after", [0, 2])
def test_a_request_migrates_off_a_lost_generation_server_with_no_token_missing_or_repeated(
        dies_after):
    """gen-0 sends ``dies_after`` tokens and falls silent; its probe says it is lost. The
    request moves on: context prefills the prompt plus every token sent, gen-1 decodes
    the rest, under a new request id, on a route that avoids gen-0."""
    generation, texts = FakeGeneration(10, [11, 12, 13, 14, 1], dying=1, dies_after=dies_after), []

    async def send(outputs, final):
        texts.append(outputs["text_output"][0])

    assert _run(generation, send) == "finished"
    assert "".join(texts) == "".join(chr(0x4E00 + i) for i in (10, 11, 12, 13, 14))
    sent = [10, 11, 12][:1 + dies_after]
    resumed_first = [10, 11, 12, 13][len(sent)]
    assert generation.calls == [(P.GENERATION_ONLY, [3, 4, 10]),
                                (P.GENERATION_ONLY, [3, 4] + sent + [resumed_first])]
    assert generation.contexts == 2 and generation.output_lens == [16, 16 - len(sent)]
    assert generation.avoided == [frozenset(), frozenset({"gen-0"})]
    assert len(set(generation.request_ids)) == 2 and len(generation.closed) == 2
    # gen-0 never made a token: it never took the KV, which goes back to the context
    assert generation.released == ([b"handle"] if dies_after == 0 else [])
    generation.close()


def test_a_request_lost_more_often_than_max_migrations_ends_in_one_clear_error():
    from triton_disagg.front.orchestrator import MAX_MIGRATIONS

    generation = FakeGeneration(10, [11, 12, 13, 14, 15, 1], dying=MAX_MIGRATIONS + 1,
                                dies_after=1)

    async def send(outputs, final):
        pass

    result = _run(generation, send)
    assert isinstance(result, EngineError) and "\n" not in str(result)
    assert f"generation server gen-{MAX_MIGRATIONS} was lost" in str(result), result
    assert len(generation.calls) == MAX_MIGRATIONS + 1
    generation.close()


# ---- the stream's key and sequence -------------------------------------------------------

def test_a_spoofed_event_is_ignored_and_the_real_stream_completes():
    """Before each real event a stranger who knows the request id (but not its key) pushes
    a token and an end: both are dropped, the client gets every real token."""
    generation, texts = FakeGeneration(10, [11, 12, 13, 1], spoof=True), []

    async def send(outputs, final):
        texts.append((outputs["text_output"][0], final))

    assert _run(generation, send) == "finished"
    assert "".join(t for t, _ in texts) == "".join(chr(0x4E00 + i) for i in (10, 11, 12, 13))
    assert [f for _, f in texts].count(True) == 1 and texts[-1][1]
    generation.close()


def test_a_gap_in_the_sequence_fails_the_request_and_stops_generation():
    """Event 1 of 4 is lost on the way: the request ends in an error naming the gap, never
    a normal end with a token missing, and generation is told to stop."""
    generation, texts = FakeGeneration(10, [11, 12, 13, 1], skip_seq=1), []

    async def send(outputs, final):
        texts.append(outputs["text_output"][0])

    result = _run(generation, send)
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

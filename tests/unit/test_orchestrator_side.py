"""The orchestrator's control flow without a server: non-streaming and aggregated requests,
short prompts served whole, a full context's answer awaited (one call), KV given back, cancels and early exits
that stop generation, and migration off a lost generation server; context and generation
are a fake transport (:class:`orchestrator_fakes.FakeGeneration`) over real ipc sockets.
The calls themselves (what they carry, the BLS route): test_engine_calls.py."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from orchestrator_fakes import FakeGeneration, engine_request, serve_one
from triton_disagg import protocol as P
from triton_disagg.errors import EngineError, RequestError, Unavailable
from triton_disagg.front.orchestrator import Orchestrator
from triton_disagg.front.token_inbox import TokenInbox


def test_non_streaming_first_token_only_and_aggregated():
    sends = []

    async def send(outputs, final):
        sends.append((outputs["text_output"][0], outputs["num_output_tokens"][0], final))

    generation = FakeGeneration(10, [11, 12, 1])
    assert serve_one(generation, send, stream=False) == "finished"
    assert sends == [("\u4e0a\u4e0b\u4e0c", 3, True)]            # exactly one response
    sends.clear()
    first_only = FakeGeneration(10, [])
    assert serve_one(first_only, send) == "finished" and first_only.calls == []
    assert sends == [("\u4e0a", 1, True)]
    aggregated = FakeGeneration(10, [11, 1])
    assert serve_one(aggregated, send, mode="aggregated") == "finished"
    assert aggregated.calls == [(P.CONTEXT_AND_GENERATION, [3, 4])]
    for fake in (generation, first_only, aggregated):
        assert len(fake.closed) == 1          # every request's route closed, once
        fake.close()


@pytest.mark.parametrize("local_prefill, whole", [(0, False), (1, False), (2, True), (9, True)])
def test_a_prompt_at_or_under_max_local_prefill_length_is_served_whole_by_generation(
        local_prefill, whole):
    """The prompt has 2 tokens: at or under the limit it goes to generation as
    context_and_generation (no context call, no handoff); over it, generation is offered it
    first if cached (it holds none of it here: declined), then disaggregated."""
    generation, texts = FakeGeneration(10, [11, 1]), []

    async def send(outputs, final):
        texts.append(outputs["text_output"][0])

    assert serve_one(generation, send, local_prefill=local_prefill) == "finished"
    offered = [(P.CONTEXT_AND_GENERATION_IF_CACHED, [3, 4])] if local_prefill else []
    if whole:
        assert generation.contexts == 0 and generation.calls == [(P.CONTEXT_AND_GENERATION, [3, 4])]
    else:
        assert generation.contexts == 1
        assert generation.calls == offered + [(P.GENERATION_ONLY, [3, 4, 10])]
    assert len(generation.closed) == 1            # one route, closed once
    generation.close()


def test_a_prompt_generation_holds_but_for_a_short_part_skips_the_context():
    """Over the limit, but generation says its uncached part is short
    (context_and_generation_if_cached accepted): no context call, the text as ever."""
    generation, texts = FakeGeneration(10, [11, 1], holds_prompt=True), []

    async def send(outputs, final):
        texts.append(outputs["text_output"][0])

    assert serve_one(generation, send, local_prefill=1) == "finished"
    assert generation.contexts == 0
    assert generation.calls == [(P.CONTEXT_AND_GENERATION_IF_CACHED, [3, 4])]
    generation.close()


def test_prompt_logprobs_are_always_prefilled_by_a_context():
    """Only a context's prefill computes the prompt's log-probs: a short prompt that asks for
    them skips local prefill, and an aggregated deployment refuses them by name."""
    asks = {"prompt_logprobs": np.array([1], np.int32)}

    async def send(outputs, final):
        pass

    generation = FakeGeneration(10, [11, 1])
    assert serve_one(generation, send, local_prefill=9, extra=asks) == "finished"
    assert generation.contexts == 1 and generation.calls == [(P.GENERATION_ONLY, [3, 4, 10])]
    refused = serve_one(generation, send, mode="aggregated", extra=asks)
    assert isinstance(refused, RequestError) and "prompt_logprobs" in str(refused)
    generation.close()


def test_overlap_asks_generation_first_and_hands_its_listener_to_the_context():
    """--overlap_kv_transfer: generation gets the prompt alone before the context, the
    context gets generation's kv_listener, and the client gets the context's first token
    before generation's, each once, in order; a client that leaves while the context call
    is out stops generation, which already holds the request."""
    generation, texts = FakeGeneration(10, [11, 12, 1]), []

    async def send(outputs, final):
        texts.append(outputs["text_output"][0] if outputs is not None else "")

    assert serve_one(generation, send, overlap=True) == "finished"
    assert generation.calls == [(P.GENERATION_AWAITING_CONTEXT, [3, 4])]
    assert generation.listeners == [b"listener-" + generation.request_ids[0].encode()]
    assert "".join(texts) == "\u4e0a\u4e0b\u4e0c"
    generation.close()
    muted, asked = FakeGeneration(10, [11, 1], mute_context=True, silent=True), []
    cancelled = serve_one(muted, send, stall=30.0, overlap=True,
                          cancel=lambda: asked.append(1) or len(asked) >= 3)
    assert cancelled == "cancelled" and muted.stops() == muted.request_ids
    muted.close()


def test_overlap_calls_the_context_only_once_generation_holds_the_blocks():
    """Generation answers an overlapped request at once, but takes its blocks in its queue's
    turn: the context is called only after generation says it took them (an event with no
    tokens), so a context never holds KV that generation has no room for (CI's overlapped
    test timed out when the two queues waited on each other)."""
    generation, texts = FakeGeneration(10, [11, 12, 1], taken_after=0.5), []

    async def send(outputs, final):
        texts.append(outputs["text_output"][0] if outputs is not None else "")

    assert serve_one(generation, send, overlap=True) == "finished"
    assert generation.order == ["taken", "context"]
    assert "".join(texts) == "\u4e0a\u4e0b\u4e0c"
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
    assert serve_one(generation, send, stall=30.0, cancel=cancel) == "cancelled"
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

    result = serve_one(generation, send, cancel=lambda: how.startswith("cancelled") and len(sent) >= 1)
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

    async def release(request_id, request, handle):
        generation.released.append(handle)
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
                    await owner.handle(inputs, engine_request(inputs), send)
                await asyncio.sleep(0)
            return len(owner.releases)
        finally:
            hung.set()
            await asyncio.sleep(0)
            inbox.close()

    assert asyncio.run(main()) == 2 and len(generation.released) == 2
    generation.close()


def test_a_full_context_is_called_once_and_its_answer_awaited():
    """A context whose pool is full keeps the request queued: its answer comes late, and the
    orchestrator waits for it (one call, no retry); a client that cancels meanwhile ends
    the request."""
    sends = []

    async def send(outputs, final):
        sends.append(final)

    generation = FakeGeneration(10, [11, 1], queued=0.3)
    started = time.monotonic()
    assert serve_one(generation, send) == "finished" and sends[-1]
    assert generation.context_calls == 1 and time.monotonic() - started >= 0.3
    sends.clear()
    cancelled = FakeGeneration(10, [11, 1], queued=10.0)
    assert serve_one(cancelled, send, cancel=lambda: True) == "cancelled" and sends == [True]
    assert cancelled.context_calls == 1 and cancelled.calls == []
    for fake in (generation, cancelled):
        fake.close()


def test_a_bls_context_call_abandoned_by_its_client_gives_its_kv_back_when_it_answers():
    """``serve all``: a BLS call cannot be stopped once sent, so when the client leaves while
    the context still queues it, its late answer's handle is released at once (not left to
    its lease)."""
    class BLSLike(FakeGeneration):
        def route(self, request_id, avoid, timeout):
            route = super().route(request_id, avoid, timeout)
            route.cancellable = False
            return route

    generation = BLSLike(10, [11, 1], queued=0.3)
    decode = lambda ids: "".join(chr(0x4E00 + i) for i in ids)   # noqa: E731

    async def main():
        inbox = TokenInbox(None, 5.0)
        orchestrator = Orchestrator(generation, inbox, "disaggregated", decode)
        inputs = {"input_ids": np.array([3, 4], np.int32), "end_id": np.array([1], np.int32),
                  "stream": np.array([True]), "request_output_len": np.array([16], np.int32)}

        async def send(outputs, final):
            pass
        try:
            outcome = await orchestrator.handle(inputs, engine_request(inputs), send,
                                                lambda: True)
            for _ in range(100):               # the late answer, then its release
                if generation.released:
                    break
                await asyncio.sleep(0.01)
            return outcome
        finally:
            inbox.close()

    assert asyncio.run(main()) == "cancelled"
    assert generation.contexts == 1 and generation.released == [b"handle"]
    generation.close()


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

    result = serve_one(generation, send, cancel=lambda: how == "client cancels" and len(sent) >= 2,
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
    the rest (``min_tokens`` too; the prompt's log-probs, sent already, not asked again),
    its other options as they were, with the new context's KV handle, under a new request
    id, on a route that avoids gen-0."""
    generation, texts = FakeGeneration(10, [11, 12, 13, 14, 1], dying=1, dies_after=dies_after), []

    async def send(outputs, final):
        texts.append(outputs["text_output"][0])

    options = {"min_tokens": np.array([2], np.int32), "random_seed": np.array([7], np.uint64),
               "prompt_logprobs": np.array([2], np.int32)}
    assert serve_one(generation, send, extra=options) == "finished"
    assert "".join(texts) == "".join(chr(0x4E00 + i) for i in (10, 11, 12, 13, 14))
    sent = [10, 11, 12][:1 + dies_after]
    resumed_first = [10, 11, 12, 13][len(sent)]
    assert generation.calls == [(P.GENERATION_ONLY, [3, 4, 10]),
                                (P.GENERATION_ONLY, [3, 4] + sent + [resumed_first])]
    assert generation.contexts == 2 and generation.handles == [b"handle"] * 2
    assert [(r.params.max_tokens, r.params.min_tokens, r.params.seed, r.params.end_id,
             r.params.prompt_logprobs) for r in generation.requests] == [
        (16, 2, 7, 1, 2), (16 - len(sent), max(0, 2 - len(sent)), 7, 1, None)]
    assert generation.avoided == [frozenset(), frozenset({"gen-0"})]
    assert len(set(generation.request_ids)) == 2 and len(generation.closed) == 2
    # gen-0 never made a token: it never took the KV, which goes back to the context
    assert generation.released == ([b"handle"] if dies_after == 0 else [])
    generation.close()


def test_a_server_lost_after_the_last_token_fails_the_request_without_moving_it():
    """gen-0 sends every token max_tokens allows but no final event, then is lost: there is
    nothing to generate elsewhere and the finish is unknown, so the stream ends with
    UNAVAILABLE naming the tokens sent (not a normal finish, not a second context call)."""
    async def send(outputs, final):
        pass

    generation = FakeGeneration(10, [11, 12, 13, 1], dying=1, dies_after=2)
    failed = serve_one(generation, send,
                       extra={"request_output_len": np.array([3], np.int32)})
    assert type(failed) is Unavailable and "sent 3 tokens" in str(failed), failed
    assert generation.contexts == 1 and len(generation.calls) == 1
    generation.close()


def test_a_forged_arrival_stamp_moves_the_request_clock_by_at_most_its_bound():
    """The arrival stamp is not sealed: one from the future, from long ago or absent starts
    the clock now; a plausible one (preprocessing's) is kept."""
    from triton_disagg.front.orchestrator import MAX_ARRIVAL_AGE_SECONDS, request_start

    now = 1000.0
    assert request_start(int((now - 0.25) * 1e9), now) == pytest.approx(now - 0.25)
    for forged in (0, int((now + 5) * 1e9), int((now - MAX_ARRIVAL_AGE_SECONDS - 1) * 1e9),
                   2**64 - 1, None):
        assert request_start(forged, now) == now


def test_a_context_answer_without_a_kv_handle_is_a_server_fault_not_a_generation_call():
    """A context that answers a first token but no ``context_phase_params`` cannot hand the
    request off: the request fails as the server's fault (EngineError: the client is told
    its kind, not blamed), and generation is not called without the KV."""
    async def send(outputs, final):
        pass

    generation = FakeGeneration(10, [11, 1], handle=b"")
    failed = serve_one(generation, send)
    assert type(failed) is EngineError and "context_phase_params" in str(failed)
    assert generation.calls == []
    generation.close()

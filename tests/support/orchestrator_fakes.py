"""What the orchestrator's unit tests share: a fake context/generation transport
(:class:`FakeGeneration`) that pushes real token frames over real ipc sockets, and
:func:`serve_one`, which serves one request through a real TokenInbox (its engine request
read by :func:`engine_request`, as the orchestrator's gate reads it)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import zmq
from engine_limits import limits_spec

from triton_disagg import protocol as P
from triton_disagg.triton import tensors
from triton_disagg import token_wire
from triton_disagg.errors import EngineError, GenerationLost
from triton_disagg.front.engine_calls import engine_inputs
from triton_disagg.front.orchestrator import Orchestrator
from triton_disagg.front.token_inbox import GenerationAnswer, TokenInbox
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.engine.sequence import EngineRequest, TokenEvent
from triton_disagg.zmq_endpoints import bind, push_socket

# A small streamed request, for the tests of the routes and transports that carry one.
SMALL_REQUEST = EngineRequest([3, 4, 5], SamplingParams(max_tokens=8), streaming=True)


class FakeGeneration:
    """Context and generation as a transport: generation answers with a real control
    address (a PULL socket the test reads) and pushes its events to the token address.
    Each request's :class:`FakeRoute` passes its calls here with its request id.

    The request's whole output is ``[first] + rest``; a call whose ``input_ids`` already
    hold the prompt (2 tokens) and k of them answers with what follows (context: the next
    token; generation: the rest), so a migrated request resumes where it left off.
    Generation calls go to servers "gen-0", "gen-1", ... in turn; the first ``dying`` of
    them push ``dies_after`` tokens, then fall silent and are lost."""

    def __init__(self, first: int, rest: list[int], silent: bool = False, queued: float = 0.0,
                 refuse: bool = False, dying: int = 0, dies_after: int = 0,
                 spoof: bool = False, skip_seq: int | None = None, mute_context: bool = False,
                 holds_prompt: bool = False, handle: bytes = b"handle",
                 taken_after: float = 0.0):
        self.first, self.rest, self.silent = first, rest, silent
        self.taken_after = taken_after  # seconds before an overlapped request's blocks are taken
        self.order: list[str] = []      # "taken" and "context", as they happen
        self.holds_prompt = holds_prompt    # context_and_generation_if_cached: served, else declined
        self.handle = handle        # the context's KV handle (b"": its answer has none)
        self.spoof = spoof          # a stranger who knows the request id pushes events too
        self.skip_seq = skip_seq    # the event numbered this one is lost on the way
        self.mute_context = mute_context          # context calls never answer
        self.timeouts: list[float] = []           # each route's deadline per call
        self.queued, self.refuse = queued, refuse   # seconds a context call waits; refuse all
        self.context_calls = 0                      # context calls made
        self.dying, self.dies_after = dying, dies_after
        self.requests: list[EngineRequest] = []   # each generation call's request
        self.avoided: list[frozenset] = []        # each route's servers to avoid
        self.released: list[bytes] = []
        self.zmq = zmq.Context.instance()
        self.control = self.zmq.socket(zmq.PULL)
        self.endpoint = bind(self.control, None, "control")
        self.request_ids: list[str] = []
        self.calls: list[tuple[str, list[int]]] = []       # (request_type, input_ids)
        self.contexts = 0                                  # context calls answered
        self.listeners: list[bytes] = []                   # each answered call's kv_listener
        self.handles: list[bytes] = []                     # each generation call's KV handle
        self.closed: list[str] = []                        # request ids whose route closed
        self.context_called: dict[str, threading.Event] = {}   # by request id

    def route(self, request_id, avoid, timeout):
        self.avoided.append(avoid)
        self.timeouts.append(timeout)
        return FakeRoute(self, request_id)

    async def context(self, request_id, request, listener):
        if self.mute_context:
            await asyncio.Event().wait()
        self.context_calls += 1
        self.order.append("context")
        self.context_called.setdefault(request_id, threading.Event()).set()
        await asyncio.sleep(self.queued)         # a full context's queue: the call waits
        self.contexts += 1
        self.listeners.append(listener)
        output, done = [self.first] + self.rest, len(request.prompt_ids) - 2
        last = "length" if done == len(output) - 1 else ""
        out = tensors.outputs([output[done]], [-0.5], -0.5, last)
        if self.handle:
            out[P.CONTEXT_PHASE_PARAMS] = np.frombuffer(self.handle, np.uint8)
        return out

    async def generate(self, request_id, request, request_type, token_address,
                       handle) -> GenerationAnswer:
        """Generation's answer; the server it went to: ``gen-<n>`` for the n-th call."""
        self.request_ids.append(request_id)
        self.calls.append((request_type, list(request.prompt_ids)))
        self.requests.append(request)
        self.handles.append(handle)
        if self.refuse:
            raise EngineError("generation refused it")
        if request_type == P.CONTEXT_AND_GENERATION_IF_CACHED and not self.holds_prompt:
            return GenerationAnswer("")                   # declined: the orchestrator goes on
        server = len(self.calls) - 1
        output = ([self.first] + self.rest)[max(1, len(request.prompt_ids) - 2):]
        if server < self.dying:
            output = output[:self.dies_after]
        awaiting = request_type == P.GENERATION_AWAITING_CONTEXT
        if not self.silent:
            threading.Thread(target=self._push, args=(request_id, token_address, output,
                                                      server >= self.dying, awaiting)).start()
        listener = b"listener-" + request_id.encode() if awaiting else b""
        return GenerationAnswer(self.endpoint.address, listener)

    def lost(self, server: int):
        return GenerationLost(f"gen-{server}", "probe refused") if server < self.dying else None

    def _push(self, request_id, token_address, output, ends, awaiting, gap=0.01):
        """One event per decode step, ``gap`` seconds apart, as a decode loop sends them;
        the last final when the server ``ends`` the request (it is not lost first). An
        ``awaiting`` (overlapped) request's first event has no tokens: its blocks taken."""
        address, key = token_wire.split_key(token_address)
        push = push_socket(self.zmq, address, 100)
        if awaiting:       # its tokens come once the context has its KV
            time.sleep(self.taken_after)
            self.order.append("taken")
            push.send(token_wire.encode_events([TokenEvent(request_id, [], seq=0, key=key)]))
            self.context_called.setdefault(request_id, threading.Event()).wait(10)
        for n, token in enumerate(output):
            reason = "stop" if ends and n == len(output) - 1 else None
            i = n + int(awaiting)       # the event's number
            if self.spoof:      # right id and sequence, a guessed key: a token, then an end
                push.send(token_wire.encode_events([
                    TokenEvent(request_id, [99], seq=i, key="guess"),
                    TokenEvent(request_id, [], finish_reason="stop", seq=i, key="")]))
            if i != self.skip_seq:
                push.send(token_wire.encode_events([TokenEvent(
                    request_id, [token], finish_reason=reason, seq=i, key=key)]))
            time.sleep(gap)
        push.close(linger=1000)

    async def release(self, request_id, request, handle):
        self.released.append(handle)

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
    cancellable = True       # as a gRPC route: a cancelled call stops at the server
    def __init__(self, fake: FakeGeneration, request_id: str):
        self.fake, self.request_id = fake, request_id
        self.server: int | None = None          # the generation call's server, once made

    async def context(self, request, listener=b""):
        return await self.fake.context(self.request_id, request, listener)

    async def generate(self, request, request_type, token_address, handle=b""):
        accepted = await self.fake.generate(self.request_id, request, request_type,
                                            token_address, handle)
        self.server = len(self.fake.calls) - 1
        return accepted

    async def lost(self):
        return None if self.server is None else self.fake.lost(self.server)

    async def release(self, request, handle):
        await self.fake.release(self.request_id, request, handle)

    def close(self):
        self.fake.closed.append(self.request_id)


def engine_request(inputs: dict[str, np.ndarray]) -> EngineRequest:
    """The engine request the orchestrator's gate reads from ``inputs`` (its tensors)."""
    return tensors.from_inputs(engine_inputs(inputs), limits_spec())


def serve_one(generation, send, stall=5.0, cancel=lambda: False, cancel_task_after=None,
         mode="disaggregated", stream=True, local_prefill=0, overlap=False, extra=None):
    """Serve one request (its inputs plus ``extra``) through a real TokenInbox; returns the
    outcome or the exception."""
    decode = lambda ids: "".join(chr(0x4E00 + i) for i in ids)   # noqa: E731 - one char per id

    async def main():
        inbox = TokenInbox(None, stall)
        orchestrator = Orchestrator(generation, inbox, mode, decode, local_prefill=local_prefill,
                                    overlap=overlap)
        inputs = {"input_ids": np.array([3, 4], np.int32), "end_id": np.array([1], np.int32),
                  "stream": np.array([stream]), "request_output_len": np.array([16], np.int32),
                  **(extra or {})}
        task = asyncio.ensure_future(orchestrator.handle(inputs, engine_request(inputs), send,
                                                         cancel))
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

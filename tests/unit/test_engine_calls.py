"""The orchestrator's calls to context and generation without a server (front/engine_calls.py):
what a call carries beside the engine request, and ``serve all``'s BLS route (a call past its
deadline is a Timeout; calls queued in a full context leave threads for the one that frees
it), over a stand-in for the stub's ``pb_utils``."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from orchestrator_fakes import SMALL_REQUEST
from triton_disagg import protocol as P
from triton_disagg.errors import Timeout
from triton_disagg.front.engine_calls import BLSTransport, call_inputs



def test_a_bls_call_past_its_deadline_is_a_timeout():
    """``serve all``: a context model that does not answer in time (a BLS call still out)."""
    class Request:
        def __init__(self, **_):
            pass

        async def async_exec(self):
            await asyncio.Event().wait()             # never answers

    pb = SimpleNamespace(Tensor=lambda name, array: (name, array), InferenceRequest=Request)
    route = BLSTransport(pb, max_calls=4).route("req-1", timeout=0.2)
    started = time.monotonic()
    with pytest.raises(Timeout, match=r"^context timed out: no answer within 0.2 s$"):
        asyncio.run(route.context(SMALL_REQUEST))
    assert time.monotonic() - started < 2


def test_bls_calls_waiting_in_a_full_context_leave_threads_for_the_calls_that_free_it():
    """``serve all``: the stub's ``async_exec`` holds a thread of the loop's default executor
    per call until it is answered. Forty context calls waiting in a full context's queue (more
    than Python's default executor has threads) must not keep out the call that frees its
    pool (here a release; in serving, generation taking the KV)."""
    freed, waiting = threading.Event(), 40

    class Response:
        def has_error(self):
            return False

        def output_tensors(self):
            return []

    class Request:
        def __init__(self, parameters, **_):
            self.frees = parameters[P.REQUEST_TYPE] == P.RELEASE_KV

        async def async_exec(self):      # as the stub runs it: the blocking call in a thread
            return await asyncio.get_running_loop().run_in_executor(None, self.exec)

        def exec(self):
            if self.frees:
                freed.set()
            elif not freed.wait(10):
                raise AssertionError("the freeing call never ran")
            return Response()

    pb = SimpleNamespace(Tensor=lambda name, array: (name, array), InferenceRequest=Request)
    transport = BLSTransport(pb, max_calls=waiting + 1)

    async def main():
        calls = [transport.route(f"r{i}", timeout=20).context(SMALL_REQUEST) for i in range(waiting)]
        calls.append(transport.route("free", timeout=20).release(SMALL_REQUEST, bytes(1)))
        return await asyncio.gather(*calls)

    started = time.monotonic()
    assert len(asyncio.run(main())) == waiting + 1
    assert time.monotonic() - started < 5


def test_a_call_carries_the_kv_handle_and_the_listener_beside_the_request():
    """What a route sends: the request's tensors, plus the handle as ``context_phase_params``
    (a handoff, a release) or generation's listener as ``kv_listener`` (overlapped)."""
    plain = call_inputs(SMALL_REQUEST)
    assert P.CONTEXT_PHASE_PARAMS not in plain and P.KV_LISTENER not in plain
    handed = call_inputs(SMALL_REQUEST, handle=b"\x01\x02")
    assert handed[P.CONTEXT_PHASE_PARAMS].tobytes() == b"\x01\x02"
    assert handed[P.CONTEXT_PHASE_PARAMS].dtype == np.uint8
    assert call_inputs(SMALL_REQUEST, listener=b"\x03")[P.KV_LISTENER].tobytes() == b"\x03"
    assert plain["input_ids"].tolist() == SMALL_REQUEST.prompt_ids

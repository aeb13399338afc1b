"""What the ``orchestrator`` model admits, checked before it routes anything, and what its
error answers say.

Invariants: a request is admitted only when its preprocessed tensors carry their seal
(:func:`triton_disagg.peers.check_seal`: it came from this deployment's preprocessing,
through the ensemble or the HTTP front), and, defence in depth, only when every input is
within the engine's limits as context and generation check them
(:func:`triton_disagg.triton.engine_request.from_inputs`) and ``input_ids`` plus
``request_output_len`` fit ``max_seq_len``. An answer to the client names its own mistake
(:class:`RequestError`) but never a server's: an engine error or a fault is logged in
full with the request id, and the client gets its kind and that id (:func:`public_message`),
no internal URL and no exception text.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np

from triton_disagg import peers
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.errors import RequestError, ServerBusy, Timeout, Unavailable
from triton_disagg.front.engine_calls import engine_inputs
from triton_disagg.triton import engine_request
from triton_disagg.protocol import scalar

# error class -> what the client is told (the first that the error is an instance of); the
# error's status goes with it (ErrorCode): the HTTP front maps that, not these words
_PUBLIC = ((Timeout, "a server did not answer in time (timed out)"),
           (ServerBusy, "this server is busy with its most requests at once; retry later"),
           (Unavailable, "a server this request needs is unavailable now; retry later"))


class InFlightCap:
    """At most ``limit`` requests of one orchestrator instance in flight: a :meth:`slot` past
    it raises :class:`ServerBusy` at once (nothing queues behind the cap); a slot is held
    for its ``with`` block, however it ends. One event loop uses it: nothing locks."""

    def __init__(self, limit: int):
        self.limit, self.in_flight = limit, 0

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        if self.in_flight >= self.limit:
            raise ServerBusy(f"{self.in_flight} requests in flight, the most this orchestrator "
                             f"instance takes (scheduler_server.max_concurrent_requests)")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1


class OrchestratorGate:
    """``seal_key``: :func:`triton_disagg.peers.seal_key`; ``spec``: the served engine's."""

    def __init__(self, seal_key: bytes, spec: EngineSpec):
        self.seal_key, self.spec = seal_key, spec

    def check(self, inputs: dict[str, np.ndarray]) -> None:
        """Raise :class:`RequestError` unless the orchestrator may serve ``inputs``."""
        peers.check_seal(inputs, self.seal_key)
        request = engine_request.from_inputs(engine_inputs(inputs), self.spec)
        total = len(request.prompt_ids) + int(scalar(inputs, "request_output_len"))
        if total > self.spec.max_seq_len:
            raise RequestError(f"prompt ({len(request.prompt_ids)} tokens) + request_output_len "
                               f"exceeds this engine's max_seq_len {self.spec.max_seq_len}")


def public_message(exc: Exception, request_id: str) -> str:
    """What the client is told of ``exc``: a request's own mistake as it is, anything else
    by its kind and ``request_id`` (the server log has the rest)."""
    if isinstance(exc, RequestError):
        return str(exc)
    kind = next((text for cls, text in _PUBLIC if isinstance(exc, cls)),
                "internal error; the request failed")
    return f"{kind} (request {request_id}; the server log says why)"

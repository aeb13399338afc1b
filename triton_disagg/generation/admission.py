"""The generation model's per-request decisions: which phase, and how a sequence enters
the engine.

- ``context_and_generation`` (aggregated): the engine prefills and decodes.
- ``generation_only`` (disaggregated): the request carries ``context_phase_params``
  and ``input_ids`` = the prompt plus the first token the context model produced;
  the prompt's KV is fetched into this instance's pool and the sequence only decodes.
- ``context_and_generation_if_cached`` (``max_local_prefill_length``): served as
  ``context_and_generation`` when at most that many of the prompt's tokens are not in this
  instance's prefix cache, else declined at once (the orchestrator then calls the context).
- ``generation_awaiting_context`` (``--overlap_kv_transfer``): ``input_ids`` = the prompt;
  the answer carries a ``kv_listener`` for the context, and the sequence takes the KV
  layer by layer while the context prefills, then the first token with the last layer
  (:mod:`triton_disagg.kv.overlap`).

Invariants: :meth:`DecodeAdmission.declines` and :meth:`DecodeAdmission.prompt_kv` run in
``execute`` (cheap checks, a clear per-request error); :meth:`DecodeAdmission.add` runs on
the decode-loop thread, the only thread that touches the engine, and only queues the
request in the engine's scheduler, which takes its blocks (its capacity policy's share)
before any KV moves, then starts the prompt's KV fetch (:class:`FetchedKV`) into the first
ones and frees them all if the fetch fails. A sequence preempted after its fetch is
recomputed on this instance (prefill of prompt + generated tokens), never fetched again:
the handle is spent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

from triton_disagg import protocol as P
from triton_disagg.engine.scheduler import KVArrival
from triton_disagg.errors import RequestError, Unavailable, UserError
from triton_disagg.kv.handle import KVHandle
from triton_disagg.engine.sequence import EngineRequest
from triton_disagg.kv.connector import ConnectorError, KVConnector, Transfer
from triton_disagg.token_wire import WireError, split_key

if TYPE_CHECKING:
    from triton_disagg.engine.block_pool import PoolStats
    from triton_disagg.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class FetchedKV:
    """A ``generation_only`` request's prompt KV, as the engine fetches it
    (:class:`triton_disagg.engine.sequence.RemoteKV`); the request's ``input_ids`` are its
    prompt plus the first token the context produced."""

    connector: KVConnector
    handle: KVHandle
    listener: ClassVar[bytes] = b""      # nothing for the answer to carry

    @property
    def num_tokens(self) -> int:
        return self.handle.num_tokens

    @property
    def skips_cached(self) -> bool:
        """The fetch may leave out the prompt's blocks this instance's prefix cache holds."""
        return self.connector.can_skip(self.handle)

    def start(self, block_ids: list[int], cached_blocks: int = 0) -> Transfer:
        return self.connector.start_fetch(self.handle, block_ids, cached_blocks)


@dataclass(frozen=True)
class PulledKV:
    """A ``generation_awaiting_context`` request's prompt KV, read as the context announces
    it (the listener's ``nonce``; ``listener`` is what the answer carries to the context);
    the transfer's result brings the first token."""

    connector: KVConnector
    nonce: str
    num_tokens: int
    listener: bytes
    skips_cached = True      # an overlapped transfer needs one KV layout on both roles

    def start(self, block_ids: list[int], cached_blocks: int = 0) -> Transfer:
        return self.connector.start_pull(self.nonce, block_ids, cached_blocks)


PromptKV = FetchedKV | PulledKV | None     # where a request's prompt KV comes from; None: here


def read_request_parameters(parameters: str | None) -> tuple[str, str]:
    """A generation request's JSON parameters -> (``request_type``, ``token_address``); the
    address must carry the request's key (:func:`token_wire.with_key`)."""
    params = json.loads(parameters or "{}")
    address = params.get(P.TOKEN_ADDRESS)
    if not isinstance(address, str) or not address.startswith(("ipc://", "tcp://")):
        raise RequestError(f"generation streams tokens over ZeroMQ: request parameter "
                           f"{P.TOKEN_ADDRESS!r} must name the orchestrator's ipc:// or tcp:// "
                           f"address, got {address!r}")
    try:
        split_key(address)
    except WireError as exc:
        raise RequestError(f"request parameter {P.TOKEN_ADDRESS!r}: {exc}") from None
    return params.get(P.REQUEST_TYPE, P.CONTEXT_AND_GENERATION), address


class GenerationObserver(Protocol):
    """Hears a generation instance's transfers, requests and load
    (:class:`~triton_disagg.triton.metrics.Metrics`)."""

    def kv_transfer(self, strategy: str, nbytes: int, seconds: float,
                    in_flight_seconds: float, hidden_seconds: float) -> None: ...

    def request_done(self, outcome: str) -> None: ...

    def kv_pool(self, stats: PoolStats) -> None: ...

    def live_sequences(self, count: int) -> None: ...

    def steps_blocked_by_transfer(self, total: int) -> None: ...

    def preemptions(self, total: int) -> None: ...


class DecodeAdmission:
    """Admits generation requests into ``engine`` (module docstring); ``connector``: where
    ``generation_only`` and ``generation_awaiting_context`` requests' KV comes from; None in
    aggregated mode, which serves only what it prefills itself. ``local_prefill``
    (``generation_server.max_local_prefill_length``): a
    ``context_and_generation_if_cached`` request is served here when at most that many of
    its prompt's tokens are not in this instance's prefix cache."""

    def __init__(self, engine: LLMEngine, connector: KVConnector | None,
                 metrics: GenerationObserver | None = None, local_prefill: int = 0):
        self.engine, self.connector, self.metrics = engine, connector, metrics
        self.local_prefill = local_prefill

    def declines(self, request_type: str, request: EngineRequest) -> bool:
        """Does this instance decline ``request``: a ``context_and_generation_if_cached`` one
        with more than ``local_prefill`` prompt tokens not in its prefix cache (the
        orchestrator then calls the context)?"""
        if request_type != P.CONTEXT_AND_GENERATION_IF_CACHED:
            return False
        prompt = request.prompt_ids
        cached = self.engine.cached_prompt_tokens(prompt, request.params.cache_salt)
        return len(prompt) - cached > self.local_prefill

    def prompt_kv(self, request_type: str, request: EngineRequest,
                  inputs: dict[str, np.ndarray]) -> PromptKV:
        """Where a request this instance serves takes its prompt's KV from (``execute``):
        None for one it prefills itself; RequestError for a request type or KV it cannot
        take, Unavailable when the connector cannot listen now."""
        if request_type in (P.CONTEXT_AND_GENERATION, P.CONTEXT_AND_GENERATION_IF_CACHED):
            return None
        if request_type not in (P.GENERATION_ONLY, P.GENERATION_AWAITING_CONTEXT):
            raise RequestError(f"request_type {request_type!r}: the generation model serves "
                               f"{P.CONTEXT_AND_GENERATION!r}, "
                               f"{P.CONTEXT_AND_GENERATION_IF_CACHED!r}, {P.GENERATION_ONLY!r} "
                               f"and {P.GENERATION_AWAITING_CONTEXT!r}; send "
                               f"{P.CONTEXT_ONLY!r} to the context model")
        if self.connector is None:
            raise RequestError(f"{request_type}: this server runs in aggregated mode; send "
                               f"context_and_generation")
        if request_type == P.GENERATION_AWAITING_CONTEXT:
            return self._awaiting_context(request)
        data = inputs.get(P.CONTEXT_PHASE_PARAMS)
        if data is None or not np.size(data):
            raise RequestError("generation_only needs context_phase_params from the context "
                               "model's response")
        try:
            handle = self.connector.decode(np.asarray(data, dtype=np.uint8).tobytes())
        except UserError as exc:
            raise RequestError(str(exc)) from None
        if len(request.prompt_ids) != handle.num_tokens + 1:
            raise RequestError(f"generation_only: input_ids must be the {handle.num_tokens} "
                               f"prompt tokens of context_phase_params plus the first generated "
                               f"token, got {len(request.prompt_ids)} ids")
        return FetchedKV(self.connector, handle)

    def _awaiting_context(self, request: EngineRequest) -> PulledKV:
        """Listen for the KV of ``request``'s prompt (refused when the pool could never hold
        the request, before any listener is made)."""
        self.engine.blocks_needed(P.GENERATION_AWAITING_CONTEXT, len(request.prompt_ids),
                                  request.params)
        try:
            nonce, listener = self.connector.listen(len(request.prompt_ids))
        except UserError as exc:
            raise RequestError(str(exc)) from None
        except ConnectorError as exc:
            raise Unavailable(str(exc)) from None
        return PulledKV(self.connector, nonce, len(request.prompt_ids), listener)

    def add(self, request_id: str, request: EngineRequest, kv: PromptKV) -> None:
        """Queue ``request`` in the engine, its prompt KV from ``kv`` (decode-loop thread);
        RequestError (naming the sizes and the fix) when the pool could never hold it, or
        when it is invalid. Of ``input_ids``, the first ``kv.num_tokens`` are the prompt
        whose KV ``kv`` brings; the one after, if any, is the context's first token."""
        ids, params = request.prompt_ids, request.params
        if kv is None:
            self.engine.add_request(request_id, ids, params)
            return
        if len(ids) > kv.num_tokens + 1:
            raise RequestError(f"input_ids: {len(ids)} ids, but the prompt KV holds "
                               f"{kv.num_tokens} tokens (and at most one first token follows)")
        first = ids[kv.num_tokens] if len(ids) > kv.num_tokens else None
        self.engine.add_prefilled(request_id, ids[:kv.num_tokens], first, params, kv)

    def kv_arrived(self, arrival: KVArrival) -> None:
        """A request's KV is in place (decode-loop thread; ``arrival.error`` is None):
        its stats, and the instance's compute while it was in flight, of which the part
        inside ``in_flight_seconds`` was hidden (the scheduler sets both on every arrival
        that succeeded)."""
        stats, compute = arrival.result, arrival.compute
        assert stats is not None and compute is not None, "a KVArrival that succeeded"
        if self.metrics is not None:
            self.metrics.kv_transfer(self.connector.strategy, stats.nbytes, stats.seconds,
                                     stats.in_flight_seconds,
                                     compute.hidden_seconds(stats.in_flight_seconds))

    def request_done(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.request_done(outcome)

    def report(self, live_sequences: int) -> None:
        """Load gauges: the pool, and the sequences the decode loop holds; the decode steps
        blocked by a transfer and the preemptions so far (decode-loop thread)."""
        if self.metrics is not None:
            self.metrics.kv_pool(self.engine.pool.stats())
            self.metrics.live_sequences(live_sequences)
            self.metrics.steps_blocked_by_transfer(
                self.engine.scheduler.steps_blocked_by_transfer)
            self.metrics.preemptions(self.engine.scheduler.preemptions)

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()

"""Continuous-batching admission over a block pool: an engine instance's one waiting queue.

Admission is FIFO: the head of ``waiting`` takes its blocks as soon as they are free
(cached blocks no one holds count as free), before any KV moves; those behind it wait,
so nobody starves and no queued sequence holds blocks the head needs. How many blocks it
takes is the capacity policy (TensorRT-LLM's ``capacity_scheduler_policy``; the config's
``kv_cache.capacity_scheduler_policy``):

- ``MAX_UTILIZATION`` (the default; vLLM v1's and nano-vllm's): the KV of its tokens so
  far plus one block of room (``tokens_per_block`` tokens; never past ``max_total - 1``).
  A running sequence takes one more block when its next decode step needs it
  (:meth:`Scheduler.grow`), oldest first; when the pool has none left, the most recently
  admitted running sequence is preempted (:meth:`Scheduler.preempt`): its written full
  blocks are named in the prefix cache (``on_preempt``), its blocks freed (the cache may
  keep them, parked), its remote KV forgotten, and it goes back to the front of the
  queue, where its next admission recomputes the KV of its prompt and generated tokens
  here with one prefill (the cache's blocks first) and samples its next token.
- ``GUARANTEED_NO_EVICT``: every block it can ever need (``max_total - 1`` tokens of
  KV), so a running sequence never waits for memory and is never preempted.

Either way a sequence's cached prefix, shared, counts among its blocks
(:meth:`Sequence.reserve`). A sequence whose prompt KV comes from
another instance (``remote_kv``, the generation side) then starts its fetch into those
blocks and waits in the ``waiting_for_remote_kv`` state (vLLM v1's WAITING_FOR_REMOTE_KVS)
until the fetch polls done; a failed fetch ends that sequence alone, frees its blocks
and is reported by :meth:`Scheduler.take_kv_arrivals`. A sequence holding its blocks
and its KV joins ``running`` in queue order while the batch has room
(``max_batch_size``), passing over those still fetching.

The context role uses the same queue for prompts alone (:meth:`Scheduler.admit_prompts`):
in queue order, each head takes its prompt's blocks once the pool and the KV handoff have
room for them, and leaves the queue with them for one prefill pass (the caller owns them
from then on); those behind it wait, as above.

Starting and polling a fetch must not wait on the transfer (the connector copies on its
own thread): :attr:`Scheduler.steps_blocked_by_transfer` counts the admissions in which
those calls together took more than ``BLOCKED_SECONDS`` (expected 0; the metric
``disagg_decode_steps_blocked_by_transfer_total``). While a fetch is in flight the engine
reports each compute pass to :meth:`Scheduler.computed`, so that its arrival tells how much
of its time in flight the instance spent computing for others (``KVArrival.compute``;
``disagg_kv_fetch_hidden_seconds``): a fetch is *hidden* while the engine runs prefill or
decode passes for the other sequences; time in flight with nothing to compute (an idle
instance) hides nothing but stalls nothing. The scheduler starts a :class:`ComputeDuringFetch`
when it starts a fetch and adds every pass's compute interval to it (O(1)); when the fetch
polls done, :meth:`ComputeDuringFetch.hidden_seconds` trims the part of the last pass that ran
after the fetch had ended: 0 <= ``hidden_seconds(in_flight)`` <= ``in_flight``, given that
the fetch is polled before every pass (so only the last pass added can reach past its end).

Invariants: a sequence is in at most one of ``waiting`` / ``running``; in ``waiting``
the sequences holding their blocks come before those without (a preempted sequence goes
first among those without); ``running`` is in admission order; every running sequence
holds its KV (after :meth:`Scheduler.grow`, room for its next token's too); a finished,
aborted or preempted sequence holds no blocks, except that the blocks of a fetch in
flight are freed only once it polls done or failed (an aborted one waits in
``draining`` until then); only a running sequence is preempted.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from triton_disagg.engine.block_pool import BlockPool, KVCacheFullError
from triton_disagg.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from triton_disagg.kv.handle import TransferStats

WAITING: Status = "waiting"
WAITING_FOR_REMOTE_KV: Status = "waiting_for_remote_kv"
RUNNING: Status = "running"
BLOCKED_SECONDS = 0.001    # an admission's fetch starts + polls past this blocked its step
_log = logging.getLogger(__name__)


class CapacityPolicy(str, enum.Enum):
    """How much KV a sequence takes at admission (TensorRT-LLM's names and values)."""

    MAX_UTILIZATION = "MAX_UTILIZATION"          # its tokens + a block; grown; preemptible
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"  # prompt + max_tokens; never preempted


@dataclass
class ComputeDuringFetch:
    """Compute time since ``began`` (the fetch's start; readings of one monotonic clock)."""

    began: float
    total: float = 0.0            # compute seconds after ``began``, last pass included
    last_start: float = 0.0       # the last pass added, clipped to start at ``began``
    last_end: float = 0.0

    def add(self, start: float, end: float) -> None:
        """The instance computed from ``start`` to ``end`` while the fetch was in flight."""
        start = max(start, self.began)
        if end > start:
            self.total += end - start
            self.last_start, self.last_end = start, end

    def hidden_seconds(self, in_flight_seconds: float) -> float:
        """Compute time inside [``began``, ``began + in_flight_seconds``]."""
        ended = self.began + in_flight_seconds
        after_end = max(0.0, self.last_end - max(ended, self.last_start))
        return min(max(0.0, self.total - after_end), in_flight_seconds)


@dataclass(frozen=True)
class KVArrival:
    """A remote-KV fetch that ended: ``result`` is its ``poll()`` value (None: nothing
    arrived); with ``error`` set, the request is gone and its blocks are free (both set: the
    KV moved, then the first token it brought was refused). ``compute``: the
    instance's compute while it was in flight (the scheduler sets it on every arrival)."""

    request_id: str
    result: TransferStats | None = None
    error: Exception | None = None
    compute: ComputeDuringFetch | None = None


class Scheduler:
    """``clock``: the monotonic clock of fetch starts and :meth:`computed` intervals (the
    fetch thread's ``in_flight_seconds`` is measured on ``time.monotonic`` too).
    ``first_token(seq, token, logprob)``: gives a sequence the first token its fetch's result
    brought (``result.first_token`` not None: an overlapped transfer); raising fails it.
    ``on_preempt(seq)``: called before a preempted sequence's blocks are freed (the engine
    names its written full blocks in the prefix cache). :attr:`preemptions` counts them
    (``disagg_preemptions_total``)."""

    def __init__(self, pool: BlockPool, max_batch_size: int, clock=time.monotonic,
                 first_token=None, policy: CapacityPolicy = CapacityPolicy.MAX_UTILIZATION,
                 on_preempt: Callable[[Sequence], None] | None = None):
        self.pool = pool
        self.first_token = first_token
        self.clock = clock
        self.max_batch_size = max_batch_size
        self.policy = CapacityPolicy(policy)
        self.on_preempt = on_preempt
        self.preemptions = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.draining: list[Sequence] = []     # aborted while fetching: blocks still lent
        self.arrivals: list[KVArrival] = []
        self.steps_blocked_by_transfer = 0

    def __contains__(self, request_id: str) -> bool:
        return self.find(request_id) is not None

    def find(self, request_id: str) -> Sequence | None:
        return next((s for s in (*self.waiting, *self.running) if s.request_id == request_id),
                    None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.draining)

    def tokens_to_reserve(self, seq: Sequence) -> int:
        """Tokens of KV beyond what the block table already holds, taken at admission: for
        the sequence's life, or (``MAX_UTILIZATION``) its tokens so far and a block more."""
        tokens = seq.max_total - 1
        if self.policy is CapacityPolicy.MAX_UTILIZATION:
            tokens = min(tokens, seq.num_tokens + self.pool.geometry.tokens_per_block)
        return tokens - seq.block_table.num_tokens

    def add(self, seq: Sequence) -> None:
        seq.status = WAITING
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Reserve for the head, poll fetches, move what is ready to ``running`` (policy in
        the module docstring); return the newly running sequences that need prefill."""
        began = time.perf_counter()
        transfers = self._reserve() + self._poll()
        if transfers and time.perf_counter() - began > BLOCKED_SECONDS:
            self.steps_blocked_by_transfer += 1
        admitted = []
        for seq in list(self.waiting):
            if len(self.running) >= self.max_batch_size or not seq.block_table.block_ids:
                break                                   # the batch is full / none reserved
            if seq.status == WAITING:
                self.waiting.remove(seq)
                seq.status = RUNNING
                self.running.append(seq)
                admitted.append(seq)
        return [s for s in admitted if s.needs_prefill]

    def admit_prompts(self, room: int | None) -> list[Sequence]:
        """Context: take the prompt blocks of the waiting sequences in queue order while the
        pool has them, ``room`` blocks of KV handoff capacity last (None: no bound) and the
        batch has room; return them, out of the queue (the caller owns their blocks). The
        first that does not fit stops the others (FIFO)."""
        admitted: list[Sequence] = []
        while self.waiting and len(admitted) < self.max_batch_size:
            seq = self.waiting[0]
            need = seq.block_table.blocks_needed(len(seq.prompt_ids))
            if room is not None and need > room:
                break
            try:
                seq.reserve(self.pool, len(seq.prompt_ids))     # cached prefix first
            except KVCacheFullError:
                break
            room = None if room is None else room - need
            admitted.append(self.waiting.popleft())
        return admitted

    def grow(self) -> list[Sequence]:
        """Give every running sequence the block its next decode step writes into, oldest
        first, preempting the newest running ones while the pool has none (a sequence
        that is itself the newest is preempted then); return those still running, in
        order. A no-op under ``GUARANTEED_NO_EVICT`` (their blocks are all taken)."""
        for seq in list(self.running):
            if seq not in self.running:
                continue                                # preempted for an older one
            while True:
                try:
                    seq.block_table.reserve(self.pool, 1)   # nothing unless a block is full
                    break
                except KVCacheFullError:
                    victim = self.running[-1]
                    self.preempt(victim)
                    if victim is seq:
                        break
        return self.running

    def preempt(self, seq: Sequence) -> None:
        """Take a running sequence's blocks back (module docstring): it waits first among
        the sequences without blocks, to be recomputed once its blocks are free."""
        self.running.remove(seq)
        if self.on_preempt is not None:
            self.on_preempt(seq)
        seq.block_table.release(self.pool)
        seq.remote_kv = None                            # its handle is spent: recompute here
        seq.status = WAITING
        seq.preemptions += 1
        self.preemptions += 1
        holding = sum(1 for s in self.waiting if s.block_table.block_ids)
        self.waiting.insert(holding, seq)
        _log.debug("preempted %s after %d tokens (%d time(s)); %d of %d KV blocks free",
                   seq.request_id, len(seq.output_ids), seq.preemptions, self.pool.num_free,
                   self.pool.num_total, extra={"request_id": seq.request_id})

    def _reserve(self) -> int:
        """Reserve in queue order while blocks last; returns how many fetches it started."""
        started = 0
        for seq in list(self.waiting):
            table = seq.block_table
            if table.block_ids:
                continue
            try:
                seq.reserve(self.pool, self.tokens_to_reserve(seq))   # cached prefix first
            except KVCacheFullError:
                break
            if seq.remote_kv is not None:
                started += 1
                seq.status = WAITING_FOR_REMOTE_KV
                seq.fetch_compute = ComputeDuringFetch(self.clock())
                try:
                    seq.transfer = seq.remote_kv.start(
                        list(table.block_ids), seq.num_cached_tokens // table.tokens_per_block)
                except Exception as exc:  # noqa: BLE001 - that request fails alone
                    self._end_fetch(seq, KVArrival(seq.request_id, error=exc))
                    continue
                table.advance(seq.remote_kv.num_tokens - seq.num_cached_tokens)
        return started

    def _poll(self) -> int:
        """Poll every fetch in flight; returns how many it polled."""
        fetching = [s for s in (*self.waiting, *self.draining) if s.transfer is not None]
        for seq in fetching:
            try:
                result = seq.transfer.poll()
            except Exception as exc:  # noqa: BLE001 - that request fails, the rest go on
                self._end_fetch(seq, KVArrival(seq.request_id, error=exc))
                continue
            if result is not None:
                self._end_fetch(seq, KVArrival(seq.request_id, result))
        return len(fetching)

    def computed(self, start: float, end: float) -> None:
        """The engine ran a pass from ``start`` to ``end`` (``clock`` readings): every fetch
        in flight was hidden behind it (O(sequences waiting) per step)."""
        for seq in self.waiting:
            if seq.transfer is not None:
                seq.fetch_compute.add(start, end)

    def _end_fetch(self, seq: Sequence, arrival: KVArrival) -> None:
        """The fetch of ``seq`` ended: it is ready, failed (gone), or was aborted before."""
        seq.transfer = None
        arrival = dataclasses.replace(arrival, compute=seq.fetch_compute)
        seq.fetch_compute = None
        if seq in self.draining:
            self.draining.remove(seq)
            seq.block_table.release(self.pool)
            return
        if arrival.result is not None and arrival.result.first_token is not None:
            try:
                self.first_token(seq, arrival.result.first_token, arrival.result.first_logprob)
            except Exception as exc:  # noqa: BLE001 - that request fails alone
                arrival = dataclasses.replace(arrival, error=exc)
        self.arrivals.append(arrival)
        if arrival.error is None:
            seq.status = WAITING
            return
        self.waiting.remove(seq)
        seq.block_table.release(self.pool)
        if seq.finish_reason is None:     # ended; its error goes out with the arrival
            seq.finish_reason = "cancelled"

    def take_kv_arrivals(self) -> list[KVArrival]:
        """The fetches that ended since the last call, in the order they ended."""
        arrivals, self.arrivals = self.arrivals, []
        return arrivals

    def retire_finished(self) -> None:
        """Release the blocks of finished running sequences and drop them."""
        for seq in [s for s in self.running if s.finished]:
            self.running.remove(seq)
            seq.block_table.release(self.pool)

    def abort(self, request_id: str) -> bool:
        """Finish the request as "cancelled" and free its blocks (once its fetch, if one is
        in flight, has ended); False if it is unknown."""
        seq = self.find(request_id)
        if seq is None:
            return False
        (self.running if seq.status == RUNNING else self.waiting).remove(seq)
        seq.finish_reason = "cancelled"
        if seq.transfer is not None:
            seq.transfer.cancel()
            self.draining.append(seq)
        else:
            seq.block_table.release(self.pool)
        return True

"""The LLM engine: requests in, token events out, with continuous batching.

The math runs in a model runner (numpy or torch, :mod:`triton_disagg.engine.runtime`);
everything here is the one copy of the control logic both runners share.

Three ways in, so that aggregated and disaggregated serving share one engine:

- :meth:`LLMEngine.add_request` + :meth:`LLMEngine.step`: aggregated serving. Each step
  either prefills the newly admitted requests (one batched pass) or runs one batched
  decode step over every running sequence; sequences join and leave between steps.
- :meth:`LLMEngine.add_prompt` + :meth:`LLMEngine.admit_prompts` +
  :meth:`LLMEngine.prefill_reserved` (the context role's loop,
  :mod:`triton_disagg.context.prefill_loop`): queue prompts, take the blocks of those at
  the head once they fit, prefill them in one batch, sample each first token, and hand the
  filled KV blocks to the caller, who owns them from then on and frees them with
  ``engine.pool.free(block_ids)`` once they are transferred
  (:meth:`LLMEngine.reserve_prompts` takes a batch's blocks at once instead;
  :meth:`LLMEngine.prefill_only` does that and the prefill in one call, for tests and
  scripts that need no lease between the two).
- :meth:`LLMEngine.add_prefilled` (the generation side): queue a sequence whose prompt KV
  comes from another instance (a :class:`~triton_disagg.engine.sequence.RemoteKV`), plus
  its first token; once admitted it fetches that KV into its blocks, then only decodes.

Every request waits in the one queue of :class:`~triton_disagg.engine.scheduler.Scheduler`
(FIFO; ``capacity_policy`` says how much KV a sequence takes at admission: its tokens and
a block of room, grown as it decodes, the newest running sequence preempted and later
recomputed here when the pool runs out; or every block it will ever hold); a request the
pool could never hold is refused when it is added.

Prefix caching (on unless ``prefix_caching=False``; :mod:`triton_disagg.engine.block_pool`):
a prompt prefilled here (aggregated, or the context side) first takes the cached blocks of
its leading full blocks and is computed only after them (its last token always is); the
full blocks of every prompt are cached once its prefill wrote them, and those of its
generated tokens once the request finishes or is preempted (also a request whose prompt KV
came from another instance). Greedy output is the same with the cache as without it, and
with preemption as without it (a preempted sequence's draws keep their indexes).

Invariant: once every request has finished or been aborted and every fetch has ended,
``pool.num_used == 0`` (except blocks handed out by :meth:`admit_prompts` and
:meth:`reserve_prompts`, which belong to the caller); cached blocks no one holds are free.
"""

from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence as Seq

import numpy as np

from triton_disagg.engine.logprobs import TopLogprobs
from triton_disagg.engine.prompt_logprobs import PromptLogprobs, prompt_logprobs
from triton_disagg.engine.sampling import Sampler, SamplingParams
from triton_disagg.engine.scheduler import CapacityPolicy, KVArrival, Scheduler
from triton_disagg.engine.sequence import FinishReason, RemoteKV, Sequence, TokenEvent
from triton_disagg.engine.runtime import CUDA_KV_FRACTION, Runtime, make_runner, pool_blocks
from triton_disagg.engine.spec import KVLayout
from triton_disagg.engine.weights import load_engine
from triton_disagg.engine.block_pool import BlockEvents, BlockPool, BlockTable, KVCacheFullError, \
    block_hashes, cache_fingerprint
from triton_disagg.errors import RequestError


@dataclass(frozen=True)
class PrefillResult:
    """A prefilled request: its first token and the caller-owned blocks holding its KV.

    ``block_ids`` hold the KV of ``num_tokens`` (= prompt length) tokens in position
    order (the leading ``num_cached_tokens`` came from the prefix cache, in blocks other
    holders may share); they are empty when the first token already finished the request.
    """

    request_id: str
    token_id: int
    logprob: float | None
    block_ids: list[int]
    num_tokens: int
    finish_reason: FinishReason | None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None     # when its params asked
    top: TopLogprobs | None = None                    # the first token's, when asked


class LLMEngine:
    """Loads an engine directory and serves requests from one block pool.

    ``kv_max_bytes`` (``kv_cache.max_size``), ``num_blocks`` or on CUDA
    ``kv_memory_fraction`` sizes the pool (:func:`~triton_disagg.engine.runtime.pool_blocks`).
    ``kv_layout`` overrides the engine's tokens per block and KV dtype (a serving side's own
    choice). ``runtime`` picks the model runner (default: :meth:`Runtime.default`).
    ``prefix_caching`` (``kv_cache.prefix_caching``) reuses cached prompt prefixes;
    ``kv_events`` hears what enters and leaves the cache; ``capacity_policy``
    (``kv_cache.capacity_scheduler_policy``) is the scheduler's.
    """

    def __init__(self, engine_dir: str | Path, kv_max_bytes: int | None = None,
                 num_blocks: int | None = None, kv_layout: KVLayout | None = None,
                 runtime: Runtime | None = None, kv_memory_fraction: float = CUDA_KV_FRACTION,
                 prefix_caching: bool = True, kv_events: BlockEvents | None = None,
                 capacity_policy: CapacityPolicy = CapacityPolicy.MAX_UTILIZATION):
        self.spec, weights = load_engine(engine_dir)
        runtime = runtime or Runtime.default()
        geometry = self.spec.block_geometry(kv_layout)
        num_blocks = pool_blocks(runtime, self.spec, geometry, weights, num_blocks, kv_max_bytes,
                                 kv_memory_fraction)
        # On CUDA the runner holds the KV in device memory: no host copy of the pool.
        self.pool = BlockPool(geometry, num_blocks, host_array=not runtime.on_cuda,
                              prefix_caching=prefix_caching, events=kv_events)
        self.cache_fingerprint = cache_fingerprint(self.spec.fingerprint,
                                                   geometry.tokens_per_block, geometry.dtype)
        self.runtime = runtime     # its device is where the KV the runner computes lives
        self.runner = make_runner(runtime, self.spec, weights, self.pool)
        self.sampler = Sampler()
        self.scheduler = Scheduler(self.pool, self.spec.max_batch_size,
                                   first_token=functools.partial(
                                       take_first_token, self.spec.shape.vocab_size),
                                   policy=capacity_policy,
                                   on_preempt=functools.partial(
                                       cache_written, self.pool, self.cache_fingerprint))

    # ---- aggregated serving -----------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Queue a request; raises :class:`RequestError` if it is invalid or can never fit."""
        self._enqueue(self._new_sequence(request_id, prompt_ids, params))

    def blocks_needed(self, request_id: str, num_prompt_tokens: int,
                      params: SamplingParams) -> int:
        """The most blocks a sequence can hold (the KV of all but the last of prompt +
        max_tokens, capped at max_seq_len; all of them from admission under
        ``GUARANTEED_NO_EVICT``); RequestError if the pool is smaller."""
        tokens = self._max_total(num_prompt_tokens, params) - 1
        bs, total = self.pool.geometry.tokens_per_block, self.pool.num_total
        need = self.pool.geometry.blocks_for(tokens)
        if need > total:
            raise RequestError(
                f"request {request_id}: {num_prompt_tokens} prompt tokens + max_tokens "
                f"{params.max_tokens} need {tokens} tokens of KV = {need} KV blocks of {bs}, "
                f"but this pool has {total} blocks ({total * bs} tokens); lower max_tokens or "
                f"raise kv_cache.max_size")
        return need

    def step(self) -> list[TokenEvent]:
        """Run one prefill or one decode pass; return the tokens it produced."""
        new = self.scheduler.admit()
        began = self.scheduler.clock()
        if new:
            events = self._prefill(new)
        elif self.scheduler.running and self.scheduler.grow():
            events = self._decode(self.scheduler.running)
        else:
            return []
        self.scheduler.computed(began, self.scheduler.clock())
        for seq in self.scheduler.running:
            if seq.finished:
                cache_written(self.pool, self.cache_fingerprint, seq)
        self.scheduler.retire_finished()
        return events

    def abort(self, request_id: str) -> bool:
        """Stop a queued or running request and free its blocks; False if unknown."""
        return self.scheduler.abort(request_id)

    def admitted(self, request_id: str) -> bool:
        """Does the request hold its blocks (running, or waiting for its KV or a batch slot)?
        A preempted one does not, until it is admitted again."""
        seq = self.scheduler.find(request_id)
        return seq is not None and bool(seq.block_table.block_ids)

    def cached_prompt_tokens(self, prompt_ids: Seq[int], cache_salt: str | None) -> int:
        """How many of the prompt's tokens a prefill here would take from the prefix cache now
        (its leading cached full blocks, never the one holding its last token). Safe from
        any thread, as a hint: the loop may evict or add blocks before the prompt arrives."""
        if self.pool.cache is None:
            return 0
        bs = self.pool.geometry.tokens_per_block
        names = block_hashes(list(prompt_ids)[:(len(prompt_ids) - 1) // bs * bs], bs,
                             self.cache_fingerprint, cache_salt)
        return len(self.pool.match(names)) * bs

    def take_kv_arrivals(self) -> list[KVArrival]:
        """The remote-KV fetches that ended since the last call (a failed one ended its
        request, whose blocks are free)."""
        return self.scheduler.take_kv_arrivals()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def generate(self, prompts: Seq[Seq[int]],
                 params: SamplingParams | Seq[SamplingParams]) -> list[Sequence]:
        """Run ``prompts`` to completion on an idle engine; finished sequences, in order."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; drive step() instead")
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        seqs = [self._new_sequence(f"generate-{i}", p, sp)
                for i, (p, sp) in enumerate(zip(prompts, per_prompt, strict=True))]
        for seq in seqs:
            self._enqueue(seq)
        while self.has_unfinished():
            self.step()
        return seqs

    # ---- disaggregated serving --------------------------------------------------------

    def prefill_only(self, requests: Seq[tuple[str, Seq[int], SamplingParams]],
                     on_layer: Callable[[int], None] | None = None) -> list[PrefillResult]:
        """Prefill a batch now; the caller owns the returned blocks: :meth:`reserve_prompts`
        then :meth:`prefill_reserved` in one call (tests, scripts; the context role calls the
        two itself, leasing the blocks in between)."""
        return self.prefill_reserved(self.reserve_prompts(requests), on_layer)

    def add_prompt(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Queue a prompt to prefill (:meth:`admit_prompts` takes its blocks); RequestError if
        it is invalid, its id is queued already, or its KV could never fit the pool."""
        seq = self._new_sequence(request_id, prompt_ids, params)
        if request_id in self.scheduler:
            raise RequestError(f"request id {request_id!r} is already in use")
        need = self.pool.geometry.blocks_for(len(seq.prompt_ids))
        if need > self.pool.num_total:
            raise RequestError(f"request {request_id}: its prompt needs {need} KV blocks, the "
                               f"pool has {self.pool.num_total}; shorten it or raise "
                               f"kv_cache.max_size")
        self.scheduler.add(seq)

    def admit_prompts(self, room: int | None = None) -> list[Sequence]:
        """The queued prompts whose blocks are free now, in queue order, holding those blocks
        (``room``: at most this many blocks in all, the KV handoff's capacity; None: no
        bound); prefill them with :meth:`prefill_reserved`. The caller owns their blocks."""
        return self.scheduler.admit_prompts(room)

    def reserve_prompts(self, requests: Seq[tuple[str, Seq[int], SamplingParams]]
                        ) -> list[Sequence]:
        """Sequences holding the blocks of their prompts' KV, to prefill with
        :meth:`prefill_reserved`; the caller owns their blocks from here on.

        Raises :class:`KVCacheFullError` (allocating nothing) when the prompts' blocks are
        not free now, :class:`RequestError` when they could never be. A prompt's cached
        prefix is taken, shared, instead of new blocks (``num_cached_tokens``).
        """
        seqs = [self._new_sequence(rid, ids, sp) for rid, ids, sp in requests]
        geometry = self.pool.geometry
        need = sum(geometry.blocks_for(len(s.prompt_ids)) for s in seqs)
        if need > self.pool.num_total:
            raise RequestError(f"the prompts need {need} KV blocks, the pool has "
                               f"{self.pool.num_total}; send fewer or shorter prompts per batch "
                               f"or raise kv_cache.max_size")
        reserved: list[Sequence] = []
        try:
            for seq in seqs:
                seq.reserve(self.pool, len(seq.prompt_ids))
                reserved.append(seq)
        except KVCacheFullError as exc:
            for seq in reserved:
                seq.block_table.release(self.pool)
            raise KVCacheFullError(f"the prompts need {need} KV blocks ({exc})") from None
        return seqs

    def prefill_reserved(self, seqs: list[Sequence],
                         on_layer: Callable[[int], None] | None = None,
                         handed_off: frozenset[str] = frozenset()) -> list[PrefillResult]:
        """Prefill sequences :meth:`reserve_prompts` made, in one pass, and sample each first
        token. ``on_layer(li)``: called as each layer's KV lands (the runners' ``prefill``).
        A sequence its first token finished gives its blocks back (empty ``block_ids``),
        unless its request id is in ``handed_off`` (its blocks already belong to a KV
        handoff, which frees them)."""
        events = self._prefill(seqs, on_layer)
        for seq in seqs:
            if seq.finished and seq.request_id not in handed_off:
                seq.block_table.release(self.pool)
        return [PrefillResult(s.request_id, e.tokens[0], e.log_probs and e.log_probs[0],
                              list(s.block_table.block_ids), s.block_table.num_tokens,
                              s.finish_reason, s.num_cached_tokens, s.prompt_logprobs,
                              e.top and e.top[0])
                for s, e in zip(seqs, events)]   # one event (one token) per sequence

    def add_prefilled(self, request_id: str, prompt_ids: Seq[int], first_token: int | None,
                      params: SamplingParams, kv: RemoteKV, first_logprob: float = 0.0) -> None:
        """Queue a sequence whose prompt KV ``kv`` brings from another instance.

        Once admitted (all its blocks taken) the sequence starts ``kv``'s fetch into its
        first blocks and waits for it; then it only decodes. The first token must not
        already finish the request (see ``PrefillResult``). ``first_token`` None: the
        fetch's result brings it (``first_token`` of its stats: the context announces it with
        the last layer of an overlapped transfer) and the sequence takes it as the KV lands.
        The prompt's log-probs, if asked for, are the instance's that prefilled it: this
        sequence never makes them, not even when recomputed after a preemption.
        """
        seq = self._new_sequence(request_id, prompt_ids, replace(params, prompt_logprobs=None))
        if kv.num_tokens != len(seq.prompt_ids):
            raise RequestError(f"request {request_id}: its prompt has {len(seq.prompt_ids)} "
                               f"tokens but the KV to fetch holds {kv.num_tokens}")
        if first_token is not None:
            take_first_token(self.spec.shape.vocab_size, seq, first_token, first_logprob)
        seq.remote_kv = kv
        self._enqueue(seq)

    # ---- internals --------------------------------------------------------------------

    def _new_sequence(self, request_id: str, prompt_ids: Seq[int],
                      params: SamplingParams) -> Sequence:
        vocab = self.spec.shape.vocab_size
        max_context = self.runner.max_context
        array = np.asarray(prompt_ids).reshape(-1)      # [n]; its length checked first
        if not array.size:
            raise RequestError(f"request {request_id}: the prompt is empty")
        if array.size >= max_context:
            raise RequestError(f"request {request_id}: the prompt has {array.size} tokens; the "
                               f"engine allows {max_context} tokens in all (prompt + output), "
                               f"so at most {max_context - 1}; shorten it")
        if array.dtype.kind not in "iu":
            raise RequestError(f"request {request_id}: prompt token ids must be integers, "
                               f"got {array.dtype} values")
        outside = np.flatnonzero((array < 0) | (array >= vocab))
        if outside.size:
            raise RequestError(f"request {request_id}: token id {array[outside[0]]} is outside "
                               f"the vocabulary [0, {vocab})")
        ids = array.astype(np.int64).tolist()
        if params.max_token_id() >= vocab:
            raise RequestError(f"request {request_id}: end_id / stop_words / bad_words name token "
                               f"{params.max_token_id()}, outside the vocabulary [0, {vocab})")
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        bs = self.pool.geometry.tokens_per_block
        names = (block_hashes(ids, bs, self.cache_fingerprint, params.cache_salt)
                 if self.pool.cache is not None else [])
        return Sequence(request_id, ids, params, seed, BlockTable(bs),
                        max_total=self._max_total(len(ids), params), block_hashes=names)

    def _max_total(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        return min(num_prompt_tokens + params.max_tokens, self.runner.max_context)

    def _enqueue(self, seq: Sequence) -> None:
        if seq.request_id in self.scheduler:
            raise RequestError(f"request id {seq.request_id!r} is already in use")
        self.blocks_needed(seq.request_id, len(seq.prompt_ids), seq.params)
        self.scheduler.add(seq)

    def _prefill(self, seqs: list[Sequence],
                 on_layer: Callable[[int], None] | None = None) -> list[TokenEvent]:
        batch = [(s.token_ids, s.block_table.block_ids, s.block_table.num_tokens) for s in seqs]
        keep = {i for i, s in enumerate(seqs)       # not again when recomputed
                if s.params.prompt_logprobs is not None and s.prompt_logprobs is None}
        logits, every = (self.runner.prefill_keeping(batch, keep, on_layer) if keep
                         else (self.runner.prefill(batch, on_layer), {}))
        for i, rows in every.items():        # n rows: no cached prefix (Sequence.reserve)
            seqs[i].prompt_logprobs = prompt_logprobs(rows, seqs[i].prompt_ids,
                                                      seqs[i].params.prompt_logprobs)
        for s in seqs:
            s.block_table.advance(s.num_tokens - s.block_table.num_tokens)
            cache_written(self.pool, self.cache_fingerprint, s)
        return self._sample(seqs, logits)

    def _decode(self, seqs: list[Sequence]) -> list[TokenEvent]:
        positions = [s.block_table.num_tokens for s in seqs]
        for s in seqs:
            s.block_table.advance(1)
        logits = self.runner.decode([s.output_ids[-1] for s in seqs], positions,
                                    [s.block_table.block_ids for s in seqs])
        return self._sample(seqs, logits)

    def _sample(self, seqs: list[Sequence], logits: np.ndarray) -> list[TokenEvent]:
        events = []
        for seq, row in zip(seqs, logits):
            token, logprob, top = self.sampler.sample(row, seq.params, seq.prompt_ids,
                                                      seq.output_ids, seq.seed)
            events.append(seq.append(token, logprob, top))
        return events


def cache_written(pool: BlockPool, fingerprint: bytes, seq: Sequence) -> None:
    """Cache the full blocks whose KV ``seq``'s table holds (the tokens of its prompt and of
    its generated tokens but the newest), naming any not yet named (``fingerprint``: the
    engine's :func:`cache_fingerprint`; the scheduler's ``on_preempt`` hook too)."""
    if pool.cache is None:
        return
    bs, table = pool.geometry.tokens_per_block, seq.block_table
    full = table.num_tokens // bs
    named = len(seq.block_hashes)
    tokens = seq.token_ids
    if full > named:
        seq.block_hashes += block_hashes(
            tokens[named * bs:full * bs], bs, fingerprint, seq.params.cache_salt,
            parent=seq.block_hashes[-1] if named else None)
    pool.cache_blocks(table.block_ids[:full], seq.block_hashes[:full], None, tokens[:full * bs])


def take_first_token(vocab_size: int, seq: Sequence, token: int, logprob: float) -> None:
    """Give ``seq`` the first token another instance sampled; RequestError if it is not a
    token of a ``vocab_size`` vocabulary or already finishes the request (the scheduler's
    ``first_token`` hook: a function of the vocabulary, not a method, so that the scheduler
    holds no reference back to its engine and a dropped engine is freed at once)."""
    if not 0 <= int(token) < vocab_size:
        raise RequestError(f"request {seq.request_id}: first token {token} is outside "
                           f"the vocabulary [0, {vocab_size})")
    seq.append(int(token), logprob)
    if seq.finished:
        raise RequestError(f"request {seq.request_id} already finished at its first token "
                           f"({seq.finish_reason}); there is nothing to generate")

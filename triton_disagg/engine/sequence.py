"""The state of one request inside the engine, and the events a step emits.

Invariants of a :class:`Sequence`: once running with a generated token, its block table
holds the KV of ``num_tokens - 1`` tokens (all but the newest generated one, which the
next decode step feeds; a sequence with remote KV gets its first token when queued and
that KV before it runs); how far ahead its blocks are reserved is the scheduler's
capacity policy (:mod:`triton_disagg.engine.scheduler`). A preempted sequence holds no
blocks and keeps its tokens; its next prefill recomputes the KV of ``token_ids`` (prompt
and generated tokens) and samples its next token, so no token is lost or repeated.
``finish_reason`` is set once and never changes. ``block_hashes`` names the full blocks of
``token_ids`` in order (as far as they are computed: the prompt's from the start when the
pool caches prefixes); a sequence prefilled here took the cached blocks of its first
``num_cached_tokens`` tokens (whole blocks, never its last token, which is always
computed; none when it asks for its prompt's log-probs and has not had them yet, as they
need every position computed). A sequence whose prompt KV comes
from another instance takes the cached blocks of its prompt too and fetches only the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

from triton_disagg.engine.logprobs import TopLogprobs
from triton_disagg.engine.prompt_logprobs import PromptLogprobs
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.engine.block_pool import BlockPool, BlockTable
from triton_disagg.errors import ErrorCode
from triton_disagg.protocol import FinishReason     # one vocabulary, engine to client

if TYPE_CHECKING:
    from triton_disagg.engine.scheduler import ComputeDuringFetch
    from triton_disagg.kv.connector import Transfer

Status = Literal["waiting", "waiting_for_remote_kv", "running"]    # in the scheduler


class TokenEvent(NamedTuple):
    """One request's tokens made since its previous event, in order: the one form a token
    takes from the engine's step to the HTTP front (issue 28), each stage filling in its part:

    - the engine's step makes one per token (:meth:`Sequence.append`), neither numbered nor
      keyed;
    - generation's decode loop joins a request's events since its last one (:meth:`joined`),
      numbers and keys them and puts them as they are on ZeroMQ
      (:mod:`triton_disagg.token_wire`); the orchestrator reads them back into this type;
    - the orchestrator's response builder adds the text and the counts (the fields after
      ``top``) and hands them to Triton as the response tensors, which the HTTP front reads
      back into this type (:mod:`triton_disagg.protocol`).

    Invariants: ``log_probs`` and ``top``, when set, hold one entry per token (set exactly
    when the request asked for log-probs, and for alternatives); an event is final exactly
    when it carries ``finish_reason`` or ``error`` (then ``code``); ``seq`` numbers a
    request's events from generation 0, 1, 2, ... and ``key`` is the request's key
    (:mod:`triton_disagg.token_wire`). The lists are plain ints and floats (msgpack's).
    Immutable; a ``NamedTuple`` rather than a frozen dataclass because several are made per
    token on the way (one a quarter of the cost: a frozen dataclass sets each field through
    ``object.__setattr__``)."""

    request_id: str
    tokens: list[int]
    log_probs: list[float] | None = None     # only when the request asked for them
    finish_reason: FinishReason | None = None  # set on a request's last event
    error: str | None = None                 # or this, instead
    code: ErrorCode = ErrorCode.INTERNAL     # the error's code (only with an error)
    seq: int = 0                             # the request's events from generation: 0, 1, ...
    key: str = ""                            # the request's key
    top: list[TopLogprobs] | None = None     # one per token, when top_logprobs asked
    # the orchestrator's response (the response builder's; never on ZeroMQ)
    text: str = ""                           # these tokens' text
    prompt_tokens: int = 0
    completion_tokens: int = 0               # the request's tokens so far
    cached_tokens: int = 0                   # of prompt_tokens, served from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None   # the first response's, when asked

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def sent(self, finish_reason: FinishReason | None, seq: int, key: str) -> TokenEvent:
        """This event's tokens as its request's event ``seq`` with ``key``, final with
        ``finish_reason`` (when not None): what the decode loop sends."""
        return TokenEvent(self.request_id, self.tokens, self.log_probs, finish_reason,
                          seq=seq, key=key, top=self.top)

    def without_last(self) -> TokenEvent:
        """This event without its last token (and that token's log-prob and alternatives)."""
        return self._replace(tokens=self.tokens[:-1],
                             log_probs=None if self.log_probs is None else self.log_probs[:-1],
                             top=None if self.top is None else self.top[:-1])

    @staticmethod
    def joined(events: list[TokenEvent]) -> TokenEvent:
        """One request's consecutive ``events`` (none final but the last, none an error) as
        one: their tokens in order, their log-probs and alternatives when every event with
        tokens has them, the last one's end, number and key. One event is returned as it is."""
        if len(events) == 1:
            return events[0]
        last, made = events[-1], [e for e in events if e.tokens]
        log_probs = ([lp for e in made for lp in e.log_probs]
                     if all(e.log_probs is not None for e in made) else None)
        top = [t for e in made for t in e.top] if all(e.top is not None for e in made) \
            else None
        return TokenEvent(last.request_id, [t for e in events for t in e.tokens], log_probs,
                          last.finish_reason, seq=last.seq, key=last.key, top=top)


@dataclass(frozen=True)
class EngineRequest:
    """One request as the engine takes it: its prompt, how to sample, whether it streams
    (read from Triton tensors by :func:`triton_disagg.triton.tensors.from_inputs`)."""

    prompt_ids: list[int]
    params: SamplingParams
    streaming: bool


class RemoteKV(Protocol):
    """Where a sequence's prompt KV comes from (the generation side's KV connector).

    ``start(block_ids, cached_blocks)`` begins moving ``num_tokens`` tokens of KV into the
    first of ``block_ids`` (the sequence's blocks in position order), all but the first
    ``cached_blocks`` (they hold it already: the pool's prefix cache), and returns a
    :class:`~triton_disagg.kv.connector.Transfer` whose ``poll()`` is None while in
    flight, its stats once done, and raises if it failed. ``skips_cached``: whether it may
    be given ``cached_blocks`` > 0.
    """

    @property
    def num_tokens(self) -> int: ...
    skips_cached: bool

    def start(self, block_ids: list[int], cached_blocks: int) -> Transfer: ...


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int                      # params.seed, or one chosen for the request
    block_table: BlockTable
    max_total: int                 # prompt + generated tokens allowed (max_tokens, max_seq_len)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    remote_kv: RemoteKV | None = None  # its prompt KV comes from another instance
    transfer: Transfer | None = None   # that KV's fetch while in flight
    fetch_compute: ComputeDuringFetch | None = None   # the instance's compute meanwhile
    status: Status = "waiting"         # the scheduler's
    block_hashes: list[int] = field(default_factory=list)   # names of its full blocks
    num_cached_tokens: int = 0         # prompt tokens whose KV the prefix cache gave it
    prompt_logprobs: PromptLogprobs | None = None   # its prefill's, if params asked
    preemptions: int = 0               # times the scheduler took its blocks back

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        """The prompt and the generated tokens: what a prefill (or recompute) feeds."""
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_prefill(self) -> bool:
        """Its table lacks KV the next decode step reads: a new prompt, or a sequence
        preempted after generating (recomputed, :meth:`Scheduler.preempt`)."""
        return not self.output_ids or self.block_table.num_tokens < self.num_tokens - 1

    def reserve(self, pool: BlockPool, num_new_tokens: int) -> None:
        """Take the blocks of ``num_new_tokens`` more tokens of KV, all or nothing
        (:class:`~triton_disagg.engine.block_pool.KVCacheFullError`). A sequence to prefill
        here first takes the cached blocks of its leading full blocks of ``token_ids``, all
        but the last token, and so does one whose prompt KV comes from another instance when
        that fetch can leave blocks out (of its prompt, all but the prompt's last token): it
        fetches the rest, always at least the last prompt token's block, whose READ ends the
        handoff (``num_cached_tokens``; the lookup counts in the cache's queries/hits)."""
        table = self.block_table
        remote = self.remote_kv is not None
        lookup = (pool.cache is not None and not table.block_ids
                  and (self.remote_kv.skips_cached if self.remote_kv is not None
                       else self.needs_prefill and (self.params.prompt_logprobs is None
                                                    or self.prompt_logprobs is not None)))
        upto = len(self.prompt_ids) if remote else self.num_tokens
        names = self.block_hashes[:(upto - 1) // table.tokens_per_block]
        self.num_cached_tokens = table.reserve(pool, num_new_tokens, names if lookup else ())
        if lookup:
            pool.cache.count_query(upto, self.num_cached_tokens, fetched=remote)

    def append(self, token: int, logprob: float | None,
               top: TopLogprobs | None = None) -> TokenEvent:
        """Record a generated token, decide whether the sequence finished, return its event:
        one token (an int), its log-prob (0.0 when none was computed) and alternatives only
        when the request asked for them; the sequence's finish reason when it finished."""
        self.output_ids.append(token)
        if token == self.params.end_id:
            self.finish_reason = "stop"
        elif self.params.stop_index.ends(self.output_ids):
            self.finish_reason = "stop_word"
        elif self.num_tokens >= self.max_total:
            self.finish_reason = "length"
        if not self.params.return_log_probs:
            return TokenEvent(self.request_id, [int(token)], finish_reason=self.finish_reason)
        return TokenEvent(self.request_id, [int(token)], [float(logprob or 0.0)],
                          self.finish_reason, top=None if top is None else [top])

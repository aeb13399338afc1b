"""The state of one request inside the engine, and the events a step emits.

Invariants of a :class:`Sequence`: once running with a generated token, its block table
holds the KV of ``num_tokens - 1`` tokens (all but the newest generated one, which the
next decode step feeds; a sequence with remote KV gets its first token when queued and
that KV before it runs); once admitted, its blocks are reserved for ``max_total - 1``
tokens, so decode never allocates. ``finish_reason`` is set once and never changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.engine.block_pool import BlockTable

FinishReason = Literal["length", "stop", "stop_word", "aborted"]


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of one request; the last event of a request has ``finished``."""

    request_id: str
    token_id: int
    logprob: float | None          # None unless the request asked for log-probs
    finished: bool
    finish_reason: FinishReason | None


class RemoteKV(Protocol):
    """Where a sequence's prompt KV comes from (the generation side's KV connector).

    ``start(block_ids)`` begins moving ``num_tokens`` tokens of KV into the first of
    ``block_ids`` (the sequence's blocks in position order) and returns a transfer whose
    ``poll()`` is None while in flight, its result once done, and raises if it failed.
    """

    num_tokens: int

    def start(self, block_ids: list[int]) -> Any: ...


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
    transfer: Any = None               # that KV's fetch while in flight
    fetch_overlap: Any = None          # its ComputeOverlap while in flight (scheduler's)
    status: str = "waiting"            # the scheduler's: waiting, waiting_for_remote_kv, running

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_prefill(self) -> bool:
        return not self.output_ids

    def append(self, token: int, logprob: float | None) -> TokenEvent:
        """Record a generated token, decide whether the sequence finished, return its event."""
        self.output_ids.append(token)
        if token == self.params.end_id:
            self.finish_reason = "stop"
        elif self.params.stop_index.ends(self.output_ids):
            self.finish_reason = "stop_word"
        elif self.num_tokens >= self.max_total:
            self.finish_reason = "length"
        return TokenEvent(self.request_id, token,
                          logprob if self.params.return_log_probs else None,
                          self.finished, self.finish_reason)

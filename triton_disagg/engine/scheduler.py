"""Continuous-batching admission over a block pool.

Policy: FIFO, "guaranteed no evict" (TensorRT-LLM's default capacity policy). A waiting
sequence is admitted only when the batch has room (``max_batch_size``) and the pool
can reserve every block the sequence can ever need (``max_total - 1`` tokens of KV), so
a running sequence never waits for memory and is never preempted. The head of the
queue blocks those behind it, so nobody starves. A waiting sequence may hold its whole
reservation already (the generation side reserves before it queues, so that queued
sequences never hold blocks the head needs); it then waits only for a batch slot.

Invariants: a sequence is in at most one of ``waiting`` / ``running``; every running
sequence holds its full reservation; a finished or aborted sequence holds no blocks.
"""

from __future__ import annotations

from collections import deque

from triton_disagg.engine.sequence import Sequence
from triton_disagg.engine.block_pool import BlockPool


class Scheduler:
    def __init__(self, pool: BlockPool, max_batch_size: int):
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def __contains__(self, request_id: str) -> bool:
        return any(s.request_id == request_id for s in (*self.waiting, *self.running))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @staticmethod
    def tokens_to_reserve(seq: Sequence) -> int:
        """Tokens of KV beyond what the block table already holds, for the sequence's life."""
        return seq.max_total - 1 - seq.block_table.num_tokens

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move what fits from ``waiting`` to ``running``; return those that need prefill."""
        admitted = []
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            table = seq.block_table
            if table.blocks_needed(self.tokens_to_reserve(seq)) > self.pool.num_free:
                break
            table.reserve(self.pool, self.tokens_to_reserve(seq))
            self.running.append(self.waiting.popleft())
            admitted.append(seq)
        return [s for s in admitted if s.needs_prefill]

    def retire_finished(self) -> None:
        """Release the blocks of finished running sequences and drop them."""
        for seq in [s for s in self.running if s.finished]:
            self.running.remove(seq)
            seq.block_table.release(self.pool)

    def abort(self, request_id: str) -> bool:
        """Finish the request as "aborted" and free its blocks; False if it is unknown."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    seq.block_table.release(self.pool)
                    seq.finish_reason = "aborted"
                    return True
        return False

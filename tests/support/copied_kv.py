"""A context engine's prefilled KV as a generation engine fetches it, in one process
(``from copied_kv import CopiedKV``): the fake remote KV of the engine-level tests that
hand a prompt's KV from one :class:`LLMEngine` to another without a connector."""

from __future__ import annotations

from typing import Sequence

from triton_disagg.engine.llm_engine import LLMEngine, PrefillResult
from triton_disagg.kv.connector import Transfer
from triton_disagg.kv.handle import TransferStats
from triton_disagg.kv.layout import write_blocks


class CopiedKV(Transfer):
    """The KV of ``result`` (a ``prefill_only`` of ``context``), copied and converted (the
    two pools' block sizes may differ) into the blocks the generation scheduler gives it
    when it starts; then the context's blocks are freed; done at once. A KV handle is
    single use: a second ``start`` fails the test (``started`` counts them)."""

    skips_cached = False           # copies every block

    def __init__(self, context: LLMEngine, generation: LLMEngine, result: PrefillResult):
        self.context, self.generation, self.result = context, generation, result
        self.num_tokens = result.num_tokens
        self.started = 0

    def start(self, block_ids: Sequence[int], cached_blocks: int = 0) -> "CopiedKV":
        self.started += 1
        assert self.started == 1, "a spent KV handle was fetched again"
        dst = block_ids[:self.generation.pool.geometry.blocks_for(self.num_tokens)]
        write_blocks(self.context.pool.read_blocks(self.result.block_ids), self.num_tokens,
                     self.generation.pool.array, dst)
        self.context.pool.free(self.result.block_ids)
        return self

    def poll(self) -> TransferStats:
        return TransferStats(0, 0.0)

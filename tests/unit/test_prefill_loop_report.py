"""A failure while the context loop publishes its gauges (between admitting a batch and
prefilling it) neither strands the admitted requests until their deadline nor leaks the
KV blocks they took."""

from __future__ import annotations

import pytest

from context_loops import submit
from triton_disagg import protocol as P
from triton_disagg.config.settings import ContextSettings
from triton_disagg.context.prefill_loop import PrefillLoop
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.kv.secret import deployment_key, key_id
from triton_disagg.engine.sequence import EngineRequest
from waiting import wait_until


class FailingMetrics:
    """Gauges whose first publication with a request queued raises (e.g. the metrics API
    refused a value)."""

    def __init__(self) -> None:
        self.failures = 1

    def queued_prompt_tokens(self, tokens) -> None:
        if self.failures and tokens:             # the iteration that admitted the batch
            self.failures -= 1
            raise RuntimeError("metrics backend refused a value")

    def kv_pool(self, stats) -> None:
        pass

    def leases_expired(self, n) -> None:
        pass


def test_a_failed_report_does_not_strand_the_admitted_batch(demo_engine, monkeypatch):
    import triton_disagg.context.prefill_loop as prefill_loop
    from triton_disagg.engine.llm_engine import LLMEngine

    monkeypatch.setattr(prefill_loop, "REPORT_SECONDS", 0.0)       # report every iteration
    engine = LLMEngine(demo_engine, num_blocks=8)
    settings = ContextSettings(str(demo_engine), "disaggregated", (), None, None,
                               kv_strategy="host_memory", kv_max_size=0, kv_lease_seconds=30.0,
                               stream_interval=1, kv_key_id=key_id(deployment_key()))
    metrics = FailingMetrics()
    loop = PrefillLoop(engine, settings, "ctxtest_report", metrics)
    try:
        (answer,) = submit(loop, [("a", EngineRequest(list(range(3, 63)),
                                                      SamplingParams(max_tokens=8), True))],
                           wait_seconds=3.0)
        result = answer.result(timeout=2.0)          # before its deadline: not stranded
        assert not isinstance(result, Exception), result
        assert result[P.CONTEXT_PHASE_PARAMS].size and metrics.failures == 0
        loop.release(result[P.CONTEXT_PHASE_PARAMS].tobytes())
        wait_until(lambda: engine.pool.num_used == 0, 5.0, "every block back in the pool")
    finally:
        loop.close()


def test_a_handoff_that_fails_in_the_server_is_not_the_clients_mistake(demo_engine):
    """A KV transport or device copy that fails is a fault (INTERNAL: 500), not an
    INVALID_ARG (400) the client would take as its own mistake and not retry."""
    from triton_disagg.engine.llm_engine import LLMEngine
    from triton_disagg.errors import ErrorCode, code_of
    from triton_disagg.kv.connector import ConnectorError

    engine = LLMEngine(demo_engine, num_blocks=8)
    settings = ContextSettings(str(demo_engine), "disaggregated", (), None, None,
                               kv_strategy="host_memory", kv_max_size=0, kv_lease_seconds=30.0,
                               stream_interval=1, kv_key_id=key_id(deployment_key()))
    loop = PrefillLoop(engine, settings, "ctxtest_handoff_fault")

    def failing_export(block_ids, num_tokens, prefilling=False):
        loop.free(block_ids)                   # the export owns the blocks, raise or not
        raise ConnectorError("NIXL cannot register 4 KV blocks: out of memory keys")

    loop.connector.export = failing_export
    try:
        (answer,) = submit(loop, [("a", EngineRequest(list(range(3, 63)),
                                                      SamplingParams(max_tokens=8), True))])
        error = answer.result()
        assert isinstance(error, Exception) and code_of(error) is ErrorCode.INTERNAL, error
        assert "KV handoff failed" in str(error)
        wait_until(lambda: engine.pool.num_used == 0, 5.0, "every block back in the pool")
    finally:
        loop.close()

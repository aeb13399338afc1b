"""``--overlap_kv_transfer`` without a server: a real context side (engine, NIXL connector)
announces a prompt's KV to a real generation engine's NIXL connector while it prefills;
generation READs the layers as they land and decodes once the first token comes. Checked
against the aggregated engine's greedy output, and that every block goes back on every
path (done, finished at the first token, cancelled, a forged or unsigned notification)."""

from __future__ import annotations

import time

import pytest

from context_loops import prefill

from triton_disagg import protocol as P
from triton_disagg.config.settings import ContextSettings
from triton_disagg.context.prefill_loop import PrefillLoop
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.generation.decode_loop import PulledKV
from triton_disagg.kv import overlap_wire as wire
from triton_disagg.kv.connector import PoolBuffer
from triton_disagg.kv.connector_factory import make_connector
from triton_disagg.kv.handle import HandleError
from triton_disagg.kv.overlap import Announcer
from triton_disagg.kv.secret import deployment_key, key_id
from triton_disagg.engine.sequence import EngineRequest

pytest.importorskip("nixl")
PROMPT = list(range(3, 63))      # 60 tokens
WAIT_S = 20.0


def _settings(demo_engine, lease_seconds: float = 30.0) -> ContextSettings:
    return ContextSettings(str(demo_engine), "disaggregated", (), None, None,
                           kv_strategy="direct_transfer", kv_max_size=0,
                           kv_lease_seconds=lease_seconds, stream_interval=1,
                           kv_key_id=key_id(deployment_key()))


@pytest.fixture
def lease_seconds():
    return 30.0


@pytest.fixture
def sides(demo_engine, lease_seconds):
    context = PrefillLoop(LLMEngine(demo_engine, num_blocks=16),
                          _settings(demo_engine, lease_seconds), "ovctx")
    generation = LLMEngine(demo_engine, num_blocks=16)
    connector = make_connector("direct_transfer", PoolBuffer(generation.pool.array), "ovgen",
                               deployment_key(), generation.spec.fingerprint, lease_seconds)
    yield context, generation, connector
    connector.close()
    context.close()


def _await(generation: LLMEngine, connector, rid: str, params: SamplingParams,
           prompt=PROMPT) -> bytes:
    """Queue ``rid`` on generation as awaiting the context; step until it holds its blocks;
    its listener."""
    nonce, listener = connector.listen(len(prompt))
    generation.add_prefilled(rid, prompt, None, params,
                             PulledKV(connector, nonce, len(prompt), listener))
    generation.step()
    assert generation.admitted(rid)
    return listener


def _decode(generation: LLMEngine, rid: str) -> tuple[list[int], list]:
    tokens, arrivals, deadline = [], [], time.monotonic() + WAIT_S
    while generation.has_unfinished() and time.monotonic() < deadline:
        tokens += [e.tokens[0] for e in generation.step() if e.request_id == rid]
        arrivals += generation.take_kv_arrivals()
        time.sleep(0.001)
    assert not generation.has_unfinished(), "generation never finished"
    return tokens, arrivals


def _zero(engine: LLMEngine) -> bool:
    deadline = time.monotonic() + WAIT_S
    while engine.pool.num_used and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.pool.num_used == 0


def _prefill_slowly(sides, params: SamplingParams, read_layers, monkeypatch):
    """Request "r" through the overlapped path, generation's READs through ``read_layers``
    and each layer's announcement followed by 50 ms of compute (reads keep up): the
    context's answer, generation's tokens and its KV arrivals."""
    context, generation, connector = sides
    announce = Announcer.layers

    def slowly(self, done):
        announce(self, done)
        time.sleep(0.05)

    monkeypatch.setattr(connector.endpoint, "read_layers", read_layers)
    monkeypatch.setattr(Announcer, "layers", slowly)
    listener = _await(generation, connector, "r", params)
    (out,) = prefill(context, [("r", EngineRequest(PROMPT, params, True))], [listener])
    return (out,) + _decode(generation, "r")


def test_layers_are_read_while_the_context_prefills_and_the_text_is_the_aggregated_one(
        sides, demo_engine, monkeypatch):
    context, generation, connector = sides
    params = SamplingParams(max_tokens=12)
    (whole,) = LLMEngine(demo_engine).generate([PROMPT], params)
    reads: list[range] = []
    read_layers = connector.endpoint.read_layers

    def recorded(peer, handle, dst, layers, deadline):
        reads.append(layers)
        return read_layers(peer, handle, dst, layers, deadline)

    out, tokens, arrivals = _prefill_slowly(sides, params, recorded, monkeypatch)
    first = int(out["output_ids"].reshape(-1)[0])
    assert out[P.CONTEXT_PHASE_PARAMS].size       # the handle, for a release if need be
    assert [first] + tokens == whole.output_ids
    layers = generation.spec.shape.num_layers
    assert len(reads) > 1 and reads[0].start == 0 and reads[0].stop < layers   # during prefill
    assert [r.start for r in reads[1:]] == [r.stop for r in reads[:-1]] and reads[-1].stop == layers
    (arrival,) = arrivals
    assert arrival.error is None and arrival.result.first_token == first
    assert _zero(context.engine) and _zero(generation)


def test_a_first_token_that_lands_during_a_read_waits_for_the_last_layers(
        sides, demo_engine, monkeypatch):
    """The first READ (of the layers final so far) is held until the context has sent its
    first token and the dispatcher filed it: the pull must still READ the other layers
    before it ends (a FIRST read after the layer count once ended it with them unread)."""
    context, generation, connector = sides
    params = SamplingParams(max_tokens=12)
    (whole,) = LLMEngine(demo_engine).generate([PROMPT], params)
    reads: list[range] = []
    read_layers = connector.endpoint.read_layers

    def first_filed() -> bool:
        return any(p.first is not None for p in connector._layers._pulls.values())

    def held(peer, handle, dst, layers, deadline):
        nbytes = read_layers(peer, handle, dst, layers, deadline)
        if not reads:
            deadline = time.monotonic() + WAIT_S
            while not first_filed() and time.monotonic() < deadline:
                time.sleep(0.001)
            assert first_filed(), "the context's first token never reached the reader"
        reads.append(layers)
        return nbytes

    out, tokens, _ = _prefill_slowly(sides, params, held, monkeypatch)
    first = int(out["output_ids"].reshape(-1)[0])
    layers = generation.spec.shape.num_layers
    assert [first] + tokens == whole.output_ids
    assert reads[0].stop < layers and reads[-1].stop == layers, reads
    assert _zero(context.engine) and _zero(generation)


def test_a_first_token_that_finishes_the_request_ends_the_pull_and_frees_both_pools(sides):
    context, generation, connector = sides
    params = SamplingParams(max_tokens=1)
    listener = _await(generation, connector, "r", SamplingParams(max_tokens=4))
    (out,) = prefill(context, [("r", EngineRequest(PROMPT, params, True))], [listener])
    assert out["finish_reason"].reshape(-1)[0] in (b"length", "length")
    assert not out[P.CONTEXT_PHASE_PARAMS].size
    _, arrivals = _decode(generation, "r")
    (arrival,) = arrivals
    assert "finished at its first token" in str(arrival.error)
    assert _zero(context.engine) and _zero(generation)


def test_a_cancelled_request_gives_its_blocks_back_before_the_context_answers(sides):
    _, generation, connector = sides
    _await(generation, connector, "r", SamplingParams(max_tokens=4))
    assert generation.pool.num_used
    generation.abort("r")
    deadline = time.monotonic() + 2.0       # at the reader's pace, not the 30 s deadline
    while generation.has_unfinished() and time.monotonic() < deadline:
        generation.step()
        time.sleep(0.005)
    assert not generation.has_unfinished() and generation.pool.num_used == 0


def test_notifications_without_the_nonce_or_signature_are_not_acted_on(sides):
    context, generation, connector = sides
    params = SamplingParams(max_tokens=6)
    listener = _await(generation, connector, "r", params)
    parsed = wire.decode_listener(listener, deployment_key())
    stranger = context.connector.endpoint.agent
    peer = stranger.connect(parsed.agent_name, parsed.contact)
    stranger.notify(peer, wire.message(wire.FAILED, "0" * 32, b"not yours"))   # wrong nonce
    stranger.notify(peer, b"tdov-x:garbage")
    with pytest.raises(HandleError, match="not signed"):
        wire.decode_listener(listener[:-1] + bytes([listener[-1] ^ 1]), deployment_key())
    time.sleep(0.05)
    generation.step()
    assert not generation.take_kv_arrivals()          # still waiting: nothing was acted on
    stranger.notify(peer, wire.message(wire.HANDLE, parsed.nonce, b"TDKV unsigned"))
    _, arrivals = _decode(generation, "r")
    (arrival,) = arrivals
    assert "bad tdov-h notification" in str(arrival.error)
    assert _zero(generation)


def test_a_context_tried_after_one_that_failed_mid_transfer_is_followed(sides, demo_engine):
    """The orchestrator retries a context server that did not answer on another, with the same
    listener: the first may have leased and announced its blocks already. Generation follows
    the handle that came last, ignores the first server from then on, and decodes the
    aggregated text; the first server's lease is left to its own end (released here)."""
    context, generation, connector = sides
    params = SamplingParams(max_tokens=8)
    (whole,) = LLMEngine(demo_engine).generate([PROMPT], params)
    listener = _await(generation, connector, "r", params)
    first = PrefillLoop(LLMEngine(demo_engine, num_blocks=16), _settings(demo_engine),
                        "ovctx-first")
    try:
        (seq,) = first.engine.reserve_prompts([("r", PROMPT, params)])
        stale = first.connector.export(list(seq.block_table.block_ids), len(PROMPT),
                                       prefilling=True)
        announcer = first.connector.announcer(listener)
        announcer.handle(stale)
        announcer.layers(1)                          # then it went silent
        time.sleep(0.05)
        (out,) = prefill(context, [("r", EngineRequest(PROMPT, params, True))], [listener])
        tokens, arrivals = _decode(generation, "r")
        assert [int(out["output_ids"].reshape(-1)[0])] + tokens == whole.output_ids
        assert arrivals[0].error is None
        first.release(stale)
        assert _zero(first.engine) and _zero(context.engine) and _zero(generation)
    finally:
        first.close()


def test_a_generation_that_cannot_be_reached_leaves_an_ordinary_handoff(sides, demo_engine):
    """Generation died after it answered (its agent is gone): the context does not fail the
    request, whose handle the orchestrator holds; it gives the KV back (or migrates the
    request: generation is lost) as after any handoff."""
    context, generation, connector = sides
    params = SamplingParams(max_tokens=6)
    listener = _await(generation, connector, "r", params)
    connector.close()
    (out,) = prefill(context, [("r", EngineRequest(PROMPT, params, True))], [listener])
    assert not isinstance(out, Exception), out
    assert out[P.CONTEXT_PHASE_PARAMS].size and context.engine.pool.num_used
    context.release(out[P.CONTEXT_PHASE_PARAMS].tobytes())
    assert _zero(context.engine)


@pytest.mark.parametrize("lease_seconds", [0.5])
def test_a_prefill_longer_than_the_lease_keeps_it_while_layers_land(sides, demo_engine,
                                                                     monkeypatch):
    """Each layer restarts the lease on both sides: a prefill of 4 x 0.3 s outlasts a 0.5 s
    lease and the request still decodes the aggregated text."""
    context, generation, connector = sides
    params = SamplingParams(max_tokens=6)
    (whole,) = LLMEngine(demo_engine).generate([PROMPT], params)
    announce = Announcer.layers

    def slowly(self, done):
        announce(self, done)
        time.sleep(0.3)

    monkeypatch.setattr(Announcer, "layers", slowly)
    listener = _await(generation, connector, "r", params)
    (out,) = prefill(context, [("r", EngineRequest(PROMPT, params, True))], [listener])
    tokens, arrivals = _decode(generation, "r")
    assert arrivals[0].error is None, arrivals[0].error
    assert [int(out["output_ids"].reshape(-1)[0])] + tokens == whole.output_ids
    assert context.connector.expired_total() == 0
    assert _zero(context.engine) and _zero(generation)


@pytest.mark.parametrize("lease_seconds", [1.0])
def test_time_queued_on_generation_does_not_count_against_the_wait_for_the_context(
        sides, demo_engine):
    """The orchestrator calls the context only once generation holds the sequence's blocks,
    so the pull's wait for the handle starts again then: 0.7 s queued on generation and 0.7 s
    before the context answers, within a lease of 1 s each, decode the aggregated text (the
    wait counted from the listen had ended the pull)."""
    context, generation, connector = sides
    params = SamplingParams(max_tokens=6)
    (whole,) = LLMEngine(demo_engine).generate([PROMPT], params)
    nonce, listener = connector.listen(len(PROMPT))
    time.sleep(0.7)                                    # queued behind others on generation
    generation.add_prefilled("r", PROMPT, None, params,
                             PulledKV(connector, nonce, len(PROMPT), listener))
    generation.step()
    assert generation.admitted("r")
    time.sleep(0.7)                                    # the context is called, and queues
    (out,) = prefill(context, [("r", EngineRequest(PROMPT, params, True))], [listener])
    tokens, arrivals = _decode(generation, "r")
    assert arrivals[0].error is None, arrivals[0].error
    assert [int(out["output_ids"].reshape(-1)[0])] + tokens == whole.output_ids
    assert _zero(context.engine) and _zero(generation)


def test_a_device_kv_is_staged_to_the_host_layer_by_layer(demo_engine, monkeypatch):
    """The torch runner with its KV apart from the host array (device memory on CUDA, faked
    on the CPU by a clone and a CUDA runtime label, as in test_device_kv_staging): each
    layer is copied to the staging rows as it lands, before generation hears of it, so the
    text is the aggregated one."""
    from triton_disagg.engine.runtime import Runtime

    engine = LLMEngine(demo_engine, num_blocks=16, runtime=Runtime("torch", "cpu", "float32"))
    engine.runner.kv = engine.runner.kv.clone()          # fake device memory
    engine.runtime = Runtime("torch", "cuda", "float32")  # so the connector stages it
    context = PrefillLoop(engine, _settings(demo_engine), "ovctx-dev")
    assert context.connector.pool.staging is not None
    generation = LLMEngine(demo_engine, num_blocks=16)
    connector = make_connector("direct_transfer", PoolBuffer(generation.pool.array), "ovgen-dev",
                               deployment_key(), generation.spec.fingerprint, 30.0)
    staged: list[range] = []
    to_host = engine.runner.blocks_to_host
    monkeypatch.setattr(engine.runner, "blocks_to_host",
                        lambda ids, host, rows, layers=None: staged.append(layers)
                        or to_host(ids, host, rows, layers))
    try:
        params = SamplingParams(max_tokens=8)
        (whole,) = LLMEngine(demo_engine).generate([PROMPT], params)
        listener = _await(generation, connector, "r", params)
        (out,) = prefill(context, [("r", EngineRequest(PROMPT, params, True))], [listener])
        tokens, arrivals = _decode(generation, "r")
        assert arrivals[0].error is None, arrivals[0].error
        assert [int(out["output_ids"].reshape(-1)[0])] + tokens == whole.output_ids
        layers = engine.spec.shape.num_layers
        assert staged == [range(i, i + 1) for i in range(layers)]
        assert _zero(engine) and _zero(generation)
    finally:
        connector.close()
        context.close()


def test_a_next_turn_reads_only_the_blocks_generations_cache_lacks(sides, demo_engine,
                                                                   monkeypatch):
    """Generation's prefix cache with an overlapped transfer: turn 2 (turn 1's prompt and
    output plus 4 tokens) takes the blocks turn 1 left cached on generation and READs only
    the blocks after them, layer by layer as they land; its text is the uncached run's, and
    the context's lease ends (its pool back to 0) though its first blocks were never read."""
    context, generation, connector = sides
    params = SamplingParams(max_tokens=12)
    read_layers, reads = connector.endpoint.read_layers, []

    def recorded(peer, handle, dst, layers, deadline):
        reads.append(len(dst))
        return read_layers(peer, handle, dst, layers, deadline)

    monkeypatch.setattr(connector.endpoint, "read_layers", recorded)
    texts, prompt = [], PROMPT
    for turn in range(2):
        reads.clear()
        listener = _await(generation, connector, f"t{turn}", params, prompt)
        (out,) = prefill(context, [(f"t{turn}", EngineRequest(prompt, params, True))],
                         [listener])
        tokens, _ = _decode(generation, f"t{turn}")
        texts.append([int(out["output_ids"].reshape(-1)[0])] + tokens)
        (whole,) = LLMEngine(demo_engine, prefix_caching=False).generate([prompt], params)
        assert texts[-1] == whole.output_ids
        assert _zero(context.engine) and _zero(generation)
        blocks = generation.pool.geometry.blocks_for(len(prompt))
        if turn:                     # 60 + 12 - 1 tokens held: 4 blocks of 16 cached
            assert set(reads) == {blocks - 4} and generation.pool.cache.hit_tokens == 64
        else:
            assert set(reads) == {blocks}
        prompt = prompt + texts[-1] + [7, 8, 9, 10]
    # what each side prefilled (disagg_prefix_cache_prefilled_total): generation fetched
    # every token its cache lacked and prefilled none; the context all it did not hold
    gen, ctx = generation.pool.cache, context.engine.pool.cache
    assert gen.query_tokens > gen.hit_tokens and gen.prefilled_tokens == 0
    assert ctx.prefilled_tokens == ctx.query_tokens - ctx.hit_tokens > 0

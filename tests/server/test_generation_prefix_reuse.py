"""Generation's own prefix cache in disaggregated `serve all` (issue 29, item 3), under both KV
strategies and with the overlapped transfer: a conversation's next turn fetches from the
context only the KV blocks that the generation instance does not hold already, and a turn of
which at most ``max_local_prefill_length`` tokens are not cached there skips the context. The
greedy text is the uncached run's, no block is held at rest on either role, and no lease is
left to expire (the context's handoff ends as a whole even when only part of it is read).

Prompts are token ids (the OpenAI front takes them as they are), so a turn's prompt is
exactly the previous turn's prompt and output plus new tokens."""

from __future__ import annotations

import time

import numpy as np
import pytest

import servers
from triton_disagg.routing.scrape import delta, scrape, total
from waiting import wait_until

MODEL = "engine"           # the model id: the engine directory's name (conftest's)
LOCAL_PREFILL = 24         # generation_server.max_local_prefill_length
LEASE_SECONDS = 4          # kv_cache.lease_seconds: short, so an unended handoff shows
FIRST_TURN, MAX_TOKENS = 70, 12
BLOCK = 16                 # the demo engine's tokens per block
BLOCK_BYTES = 4 * 2 * BLOCK * 4 * 32 * 4    # [L, 2, bs, kvh, hd] float32


@pytest.fixture(scope="module", params=["direct_transfer", "host_memory", "overlap"])
def server(request, demo_engine, tmp_path_factory):
    assert demo_engine.name == MODEL
    work = tmp_path_factory.mktemp(f"serve-reuse-{request.param}")
    config = work / "disagg_config.yaml"
    strategy = "host_memory" if request.param == "host_memory" else "direct_transfer"
    config.write_text(
        f"model: {{engine: {demo_engine}}}\n"
        f"kv_cache: {{max_size: 16MB, strategy: {strategy}, lease_seconds: {LEASE_SECONDS}, "
        f"overlap_transfer: {str(request.param == 'overlap').lower()}}}\n"
        f"generation_server: {{max_local_prefill_length: {LOCAL_PREFILL}}}\n")
    with servers.serve("all", ["-c", str(config)], work / "run") as served:
        yield served


@pytest.fixture(scope="module")
def offline(demo_engine):
    """``(prompt ids, max_tokens) -> output ids``: greedy, stops at eos, no prefix cache."""
    from triton_disagg.engine.llm_engine import LLMEngine
    from triton_disagg.engine.sampling import SamplingParams

    engine = LLMEngine(demo_engine, num_blocks=256, prefix_caching=False)
    assert engine.pool.geometry.tokens_per_block == BLOCK
    assert engine.pool.geometry.block_nbytes == BLOCK_BYTES

    def run(ids: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, end_id=engine.spec.eos_token_id)
        (seq,) = engine.generate([ids], params)
        return seq.output_ids
    return run


@pytest.fixture(scope="module")
def tokenizer(demo_engine):
    from triton_disagg.front.tokenizer import Tokenizer

    return Tokenizer(demo_engine)


def _fresh(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 2000, n).tolist()


def _turn(client, tokenizer, offline, ids: list[int]) -> list[int]:
    """Send one turn; its greedy text must be the uncached run's. Returns its output ids."""
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS,
                                    temperature=0)
    out = offline(ids, MAX_TOKENS)
    assert got.choices[0].text == tokenizer.decode(out)
    return out


def _settled(server, before, expected: dict[tuple[str, str], float]) -> None:
    """Wait until each ``(metric, role)`` moved by its expected amount since ``before``
    (servers publish their counters every half second) and no block is held on any role."""
    seen: dict = {}

    def done() -> bool:
        now = scrape(server.metrics)
        seen.update({key: delta(before, now, key[0], role=key[1]) for key in expected})
        seen["blocks used"] = total(now, "disagg_kv_blocks_used")
        return seen["blocks used"] == 0 and all(seen[k] == v for k, v in expected.items())
    try:
        wait_until(done, 10, "the counters", poll=0.1)
    except AssertionError:
        raise AssertionError(f"expected {expected} and 0 blocks used, saw {seen}") from None


def _no_lease_expired(server, before) -> None:
    """Past the lease length: the context reclaimed no handoff (each one ended)."""
    time.sleep(LEASE_SECONDS + 1.5)
    assert delta(before, scrape(server.metrics), "disagg_kv_leases_expired_total") == 0


def test_a_next_turn_fetches_only_the_blocks_generation_lacks(server, client, tokenizer,
                                                              offline):
    """Turn 1 fetches every block of its prompt. Turn 2 (turn 1's prompt and output plus 40
    new tokens: more than max_local_prefill_length uncached, so the context prefills it)
    finds turn 1's blocks in the generation instance's prefix cache: it fetches only the
    blocks after them (the prefix-cache hit counter on generation counts the tokens not
    fetched), and its text is the uncached text."""
    first = _fresh(1, FIRST_TURN)
    before = scrape(server.metrics)
    out = _turn(client, tokenizer, offline, first)
    fetched = -(-len(first) // BLOCK)
    _settled(server, before, {("disagg_kv_transfer_bytes_total", "generation"):
                              fetched * BLOCK_BYTES,
                              ("disagg_prefix_cache_hits_total", "generation"): 0})

    second = first + out + _fresh(2, 40)
    held = (len(first) + len(out) - 1) // BLOCK       # full blocks of KV generation held
    reused = min(held, (len(second) - 1) // BLOCK)
    assert reused >= 4
    before = scrape(server.metrics)
    _turn(client, tokenizer, offline, second)
    _settled(server, before, {
        ("disagg_kv_transfer_bytes_total", "generation"):
            (-(-len(second) // BLOCK) - reused) * BLOCK_BYTES,
        ("disagg_prefix_cache_hits_total", "generation"): reused * BLOCK})
    assert delta(before, scrape(server.metrics), "nv_inference_request_success",
                 model="context") == 1
    _no_lease_expired(server, before)


def test_a_turn_with_a_short_uncached_part_skips_the_context(server, client, tokenizer,
                                                             offline):
    """max_local_prefill_length decided on the tokens generation does not hold: turn 2 is
    longer than the limit, but all but a few of its tokens are cached on the generation
    instance, so generation prefills it itself (the context serves no request) and its text
    is the uncached text; a long prompt generation does not hold still goes to the context."""
    first = _fresh(3, FIRST_TURN)
    before = scrape(server.metrics)
    out = _turn(client, tokenizer, offline, first)
    _settled(server, before, {})
    assert delta(before, scrape(server.metrics), "nv_inference_request_success",
                 model="context") == 1

    second = first + out + _fresh(4, 4)
    cached = min((len(first) + len(out) - 1) // BLOCK, (len(second) - 1) // BLOCK) * BLOCK
    assert len(second) > LOCAL_PREFILL >= len(second) - cached
    before = scrape(server.metrics)
    _turn(client, tokenizer, offline, second)
    _settled(server, before, {("disagg_prefix_cache_hits_total", "generation"): cached,
                              ("disagg_kv_transfer_bytes_total", "generation"): 0})
    assert delta(before, scrape(server.metrics), "nv_inference_request_success",
                 model="context") == 0
    _no_lease_expired(server, before)

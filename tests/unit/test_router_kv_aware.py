"""The kv_aware router policy: the server holding the prompt's prefix wins at equal load,
load stays in the cost (a hot server with the prefix loses to an idle one), untrusted
overlaps (stale or gapped events, no publisher, no token ids) fall back to least_loaded
with one log line per server and a counted decision mode, generation routes by load."""

from __future__ import annotations

import logging
from typing import Sequence

import pytest
from test_router import Source

from triton_disagg.routing.discovery.record import Load
from triton_disagg.routing.kv_events import BlockStored, KVEventBatch
from triton_disagg.routing.kv_index import KvIndex
from triton_disagg.routing.router import (FALLBACK, LOAD, OVERLAP, KvAwareness, Member,
                                          Router)

TPB = 4


def hasher(token_ids: Sequence[int], tokens_per_block: int, salt: str | None) -> list[int]:
    """Chained per full block, as the engine's: each names its whole prefix."""
    full = len(token_ids) // tokens_per_block
    return [hash((salt, tuple(token_ids[:(i + 1) * tokens_per_block]))) & (2**64 - 1)
            for i in range(full)]


class Decisions:
    def __init__(self) -> None:
        self.modes: list[tuple[str, str]] = []

    def route_decision(self, role: str, mode: str) -> None:
        self.modes.append((role, mode))


def member(url: str, load: Load = Load(), **kwargs) -> Member:
    kwargs.setdefault("kv_events", (f"ipc://{url}",))
    return Member(url, TPB, 1000, load, **kwargs)


def heard(index: KvIndex, *members: Member) -> None:
    """A heartbeat from each member's publishers: their events are fresh."""
    for m in members:
        for address in m.kv_events:
            index.batch(address, KVEventBatch(0.0, []))


def holds(index: KvIndex, m: Member, token_ids: list[int], salt: str | None = None) -> None:
    hashes = hasher(token_ids, TPB, salt)
    index.batch(m.kv_events[0], KVEventBatch(0.0, [
        BlockStored(hashes, None, token_ids[:len(hashes) * TPB], TPB, None, None)]))


def router_over(*members: Member, role: str = "context") -> tuple[Router, KvIndex, Decisions]:
    index, decisions = KvIndex(), Decisions()
    heard(index, *members)
    router = Router(role, "kv_aware", Source(*members), KvAwareness(index, hasher), decisions)
    return router, index, decisions


PROMPT = list(range(64))            # 16 blocks


def test_the_server_holding_the_prefix_wins_at_equal_load():
    a, b, c = member("a:1"), member("b:1"), member("c:1")
    router, index, decisions = router_over(a, b, c)
    holds(index, b, PROMPT[:48])                          # 12 of the 16 blocks
    holds(index, c, PROMPT[:16])                          # 4
    for _ in range(3):                                    # whatever the turn
        assignment = router.take(len(PROMPT), token_ids=PROMPT)
        assert assignment.url == "b:1"
        assignment.release()
    assert decisions.modes == [("context", OVERLAP)] * 3
    assert router.in_flight == {}


def test_a_cache_hit_counts_only_its_uncached_tokens_in_flight():
    """A hit queues little prefill where it lands: the next cold prompt goes there, not
    behind the other server's real prefill (counting the hit's whole prompt did)."""
    a, b = member("a:1"), member("b:1")
    router, index, _ = router_over(a, b)
    holds(index, a, PROMPT)                               # all 16 blocks
    hit = router.take(len(PROMPT) + 1, token_ids=PROMPT + [64])
    assert (hit.url, router.in_flight["a:1"]) == ("a:1", 1)
    cold = [1000 + i for i in range(40)]
    elsewhere = router.take(len(cold), token_ids=cold)
    assert elsewhere.url == "b:1"                         # a holds 1 token of work, b none
    second = [2000 + i for i in range(40)]
    assert router.take(len(second), token_ids=second).url == "a:1"   # 1 < 40 queued on b
    whole = router.take(len(PROMPT), token_ids=PROMPT)    # wholly cached: its last token
    assert whole.url == "a:1" and whole.cost == 1
    hit.release()
    whole.release()


def test_a_salt_names_other_blocks():
    a, b = member("a:1"), member("b:1")
    router, index, _ = router_over(a, b)
    holds(index, b, PROMPT, salt="tenant-1")
    assert router.take(64, token_ids=PROMPT, salt="tenant-1").url == "b:1"
    router.in_flight.clear()
    other = [router.take(64, token_ids=PROMPT, salt="tenant-2").url for _ in range(2)]
    assert sorted(other) == ["a:1", "b:1"]                 # no overlap: load (and turns)


def test_load_stays_in_the_cost_a_hot_server_with_the_prefix_loses():
    hot = member("a:1", Load(free_kv_blocks=1000, queued_prompt_tokens=4000))
    idle = member("b:1", Load(free_kv_blocks=1000, queued_prompt_tokens=0))
    router, index, decisions = router_over(hot, idle)
    holds(index, hot, PROMPT)                             # the whole prompt cached there
    # hot: (4000 + 0) / 4 = 1000 blocks; idle: (0 + 64) / 4 = 16
    assert router.take(64, token_ids=PROMPT).url == "b:1"
    assert decisions.modes == [("context", LOAD)]


def test_blocks_held_by_live_requests_count_as_load():
    full = member("a:1", Load(free_kv_blocks=100, queued_prompt_tokens=0))   # 900 held
    empty = member("b:1", Load(free_kv_blocks=1000, queued_prompt_tokens=0))
    router, index, _ = router_over(full, empty)
    holds(index, full, PROMPT)
    assert router.take(64, token_ids=PROMPT).url == "b:1"


def test_a_modest_queue_does_not_outweigh_a_long_cached_prefix():
    prompt = list(range(400))                             # 100 blocks
    warm = member("a:1", Load(queued_prompt_tokens=40))   # 10 blocks queued
    cold = member("b:1", Load(queued_prompt_tokens=0))
    router, index, _ = router_over(warm, cold)
    holds(index, warm, prompt)
    assert router.take(400, token_ids=prompt).url == "a:1"   # 10 + 0 < 0 + 100


def test_a_prompt_no_server_holds_is_routed_as_least_loaded_routes_it():
    """Issue 29 (c): traffic that shares nothing must cost nothing against least_loaded. A
    context server's active blocks (handoffs not yet fetched) are no prefill work, so with
    no overlap anywhere they do not move the pick: the fewest queued tokens win."""
    leased = Load(free_kv_blocks=100, queued_prompt_tokens=32)    # 900 blocks handed off
    a, b = member("a:1", leased), member("b:1", Load(free_kv_blocks=1000, queued_prompt_tokens=64))
    router, _, decisions = router_over(a, b)
    least = Router("context", "least_loaded", Source(a, b))
    for cold in ([1000 + i for i in range(40)], [2000 + i for i in range(8)]):
        assert router.take(len(cold), token_ids=cold).url == least.take(len(cold)).url == "a:1"
    assert decisions.modes == [("context", LOAD)] * 2


@pytest.mark.parametrize("why", ["stale", "gap", "no publisher", "no token ids"])
def test_untrusted_overlaps_fall_back_to_least_loaded_logged_once(why, caplog):
    busy = member("a:1", Load(queued_prompt_tokens=1000))
    quiet = member("b:1", Load(queued_prompt_tokens=0),
                   kv_events=() if why == "no publisher" else ("ipc://b:1",))
    router, index, decisions = router_over(busy, quiet)
    holds(index, busy, PROMPT)
    index.stale_seconds = 3.0
    if why == "stale":
        index.clock = lambda: 1e12                        # nothing heard for ages
    elif why == "gap":
        index.gap("ipc://b:1", 2)
    token_ids = None if why == "no token ids" else PROMPT
    caplog.set_level(logging.WARNING, logger="triton_disagg.routing.router")
    urls = [router.take(64, token_ids=token_ids).url for _ in range(3)]
    assert urls == ["b:1"] * 3                            # least loaded, not the overlap
    assert decisions.modes == [("context", FALLBACK)] * 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len({r.getMessage().split(":")[1] for r in caplog.records})
    assert lines and all("routing least_loaded" in line for line in lines)
    assert len(lines) <= 2                                # once per server, not per pick


def test_trust_comes_back_with_one_line(caplog):
    a, b = member("a:1"), member("b:1")
    router, index, decisions = router_over(a, b)
    holds(index, b, PROMPT)
    index.gap("ipc://b:1", 1)
    router.take(64, token_ids=PROMPT).release()
    index.stale_seconds, now = 3.0, index.clock()
    index.clock = lambda: now + 10                        # the gap window passed ...
    heard(index, a, b)                                    # ... and both beat again
    holds(index, b, PROMPT)
    caplog.clear()
    assert router.take(64, token_ids=PROMPT).url == "b:1"
    assert decisions.modes == [("context", FALLBACK), ("context", OVERLAP)]
    assert [r.getMessage() for r in caplog.records] == [
        "kv_aware router (context): b:1: KV events trusted again; routing on KV overlap"]


def test_overlap_is_the_best_instance_of_a_server():
    two = member("a:1", kv_events=("ipc://a:1/0", "ipc://a:1/1"))
    one = member("b:1")
    router, index, _ = router_over(two, one)
    index.batch("ipc://a:1/1", KVEventBatch(0.0, [BlockStored(
        hasher(PROMPT, TPB, None), None, PROMPT, TPB, None, None)]))
    holds(index, one, PROMPT[:8])
    assert router.take(64, token_ids=PROMPT).url == "a:1"


def test_generation_routes_by_load_under_kv_aware():
    a = member("a:1", Load(free_kv_blocks=10))
    b = member("b:1", Load(free_kv_blocks=900))
    router, index, decisions = router_over(a, b, role="generation")
    holds(index, a, PROMPT)
    assert router.take(64, token_ids=PROMPT).url == "b:1"
    assert decisions.modes == [("generation", LOAD)]

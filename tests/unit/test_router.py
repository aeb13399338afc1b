"""The scheduler's router without tritonserver: the policies (round robin order, least
loaded by tokens, unequal tokens_per_block compared fairly, ties taking turns), the
in-flight accounting returning to zero, a member that left never picked, a server that did
not answer passed over, and the one line when none is left. The gRPC transport over a pool
of these routers: :mod:`test_grpc_transport_pool`."""

from __future__ import annotations

import random

import pytest

from triton_disagg.routing.discovery.record import Load
from triton_disagg.errors import NoServer
from triton_disagg.routing.pools import StaticMembers
from triton_disagg.routing.router import Member, Router


class Source:
    """A pool whose members the test changes."""

    def __init__(self, *members: Member):
        self.current = tuple(members)

    def members(self) -> tuple[Member, ...]:
        return self.current

    def where(self) -> str:
        return "in the test"


def picks(router: Router, n: int, tokens: int = 10, release: bool = True) -> list[str]:
    assignments = [router.take(tokens) for _ in range(n)]
    if release:
        for assignment in assignments:
            assignment.release()
    return [assignment.url for assignment in assignments]


def test_round_robin_goes_round_in_url_order_whatever_the_load():
    router = Router("context", "round_robin", StaticMembers("context", ["c:1", "a:1", "b:1"]))
    assert picks(router, 7, release=False) == ["a:1", "b:1", "c:1", "a:1", "b:1", "c:1", "a:1"]


def test_least_loaded_context_takes_the_fewest_queued_prompt_tokens():
    router = Router("context", "least_loaded", Source(Member("a:1"), Member("b:1")))
    held = router.take(100)                          # a: 100 prompt tokens in flight
    assert picks(router, 3, release=False) == ["b:1", "b:1", "b:1"]   # b: 10, 20, 30 < 100
    held.release()
    assert router.in_flight == {"b:1": 30}
    # a server's published queue counts too (max with this scheduler's own figure)
    router.source.current = (Member("a:1", load=Load(queued_prompt_tokens=500)), Member("b:1"))
    assert picks(router, 2) == ["b:1", "b:1"]


def test_idle_least_loaded_servers_take_turns():
    router = Router("generation", "least_loaded", Source(Member("a:1"), Member("b:1")))
    assert picks(router, 4) == ["a:1", "b:1", "a:1", "b:1"]


def test_least_loaded_generation_counts_free_kv_in_tokens_across_block_sizes():
    """a has more free blocks (20 of 16 tokens: 320 tokens) than b (10 of 64: 640 tokens),
    so a router counting blocks picks a; counting tokens, b takes requests until what this
    scheduler sent there (whole 64-token blocks) brings it down to a's 320."""
    a = Member("a:1", tokens_per_block=16, kv_blocks_total=100, load=Load(free_kv_blocks=20))
    b = Member("b:1", tokens_per_block=64, kv_blocks_total=10, load=Load(free_kv_blocks=10))
    router = Router("generation", "least_loaded", Source(a, b))
    assert picks(router, 5, release=False) == ["b:1"] * 5         # 640, 576, ..., 384 > 320
    assert router.in_flight == {"b:1": 5 * 64}                    # 10 tokens: a block of b
    assert picks(router, 2, release=False) == ["b:1", "a:1"]      # a tie (its turn); 320 > 256
    # capacity caps a stale published load: b's 10 blocks hold 640 tokens, minus ours
    router.in_flight.clear()
    router.in_flight["b:1"] = 600                                 # 640 - 600 = 40 < a's 320
    assert picks(router, 1) == ["a:1"]


def test_least_loaded_generation_breaks_a_free_kv_tie_by_live_sequences():
    """Equal free KV in tokens (10 x 64 = 40 x 16): the server holding fewer live sequences
    (b: its waiting ones have no blocks yet) takes the request; free KV still comes first."""
    a = Member("a:1", 64, 10, Load(free_kv_blocks=10, live_sequences=3))
    b = Member("b:1", 16, 40, Load(free_kv_blocks=40, live_sequences=1))
    router = Router("generation", "least_loaded", Source(a, b))
    assert [picks(router, 1)[0] for _ in range(4)] == ["b:1"] * 4   # each released at once
    router.source.current = (a, Member("b:1", 16, 40, Load(free_kv_blocks=39, live_sequences=0)))
    assert picks(router, 1) == ["a:1"]                 # 640 free tokens > 624, whatever live


def test_in_flight_accounting_returns_to_zero_and_release_is_idempotent():
    members = [Member(f"g{i}:1", 2 ** i, 100, Load(free_kv_blocks=50)) for i in range(4)]
    router = Router("generation", "least_loaded", Source(*members))
    rng = random.Random(7)
    assignments = [router.take(rng.randint(1, 300)) for _ in range(200)]
    rng.shuffle(assignments)
    assert sum(router.in_flight.values()) == sum(assignment.cost for assignment in assignments) > 0
    for assignment in assignments:
        assignment.release()
        assignment.release()
    assert router.in_flight == {}


def test_a_member_that_left_is_never_picked_and_its_leases_still_release():
    source = Source(Member("a:1"), Member("b:1"), Member("c:1"))
    for policy in ("round_robin", "least_loaded"):
        router = Router("context", policy, source)
        on_b = [a for a in (router.take(5) for _ in range(6)) if a.url == "b:1"]
        source.current = (Member("a:1"), Member("c:1"))          # b left
        assert "b:1" not in picks(router, 50)
        for assignment in on_b:
            assignment.release()
        assert set(router.in_flight) <= {"a:1", "c:1"}
        source.current = (Member("a:1"), Member("b:1"), Member("c:1"))


def test_a_server_that_did_not_answer_is_passed_over_while_another_is_left(monkeypatch):
    from triton_disagg.routing import router as router_module

    router = Router("context", "least_loaded", Source(Member("a:1"), Member("b:1")))
    router.unanswered("a:1")                 # idle, so least loaded, but it did not answer
    assert picks(router, 4) == ["b:1"] * 4
    assert picks(router, 1, release=False) == ["b:1"] and router.take(1, ["b:1"]).url == "a:1"
    monkeypatch.setattr(router_module, "PASS_OVER_SECONDS", 0.0)
    router.unanswered("b:1")                 # passed over no time at all: back at once
    assert "b:1" in picks(router, 2)


def test_no_server_left_is_one_line_naming_the_role_and_where():
    router = Router("generation", "least_loaded", StaticMembers("generation", []))
    with pytest.raises(NoServer, match=r"^no generation server in generation_server.urls$"):
        router.take(1)
    router = Router("context", "round_robin", StaticMembers("context", ["a:1"]))
    with pytest.raises(NoServer, match=r"^no other context server to try \(in context_server"):
        router.take(1, tried=["a:1"])

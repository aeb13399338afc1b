"""The KV handoff's failure paths, with a real engine and real NIXL, without a server: a
failed prefill gives its blocks back, a request id repeated in one batch is refused (not
handed off twice), one bad NIXL notification does not cost the others of its pass, and a
remote agent a READ uses is not evicted from a small LRU under it."""

from __future__ import annotations

import time

import numpy as np
import pytest

from context_loops import prefill

from kv_peers import FP, CountingPool, make_pool
from triton_disagg import readers
from triton_disagg.config.settings import ContextSettings
from triton_disagg.context.prefill_loop import PrefillLoop
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.errors import EngineError, RequestError
from triton_disagg.kv.secret import deployment_key, key_id
from triton_disagg.engine.sequence import EngineRequest

PROMPT = list(range(3, 63))      # 60 tokens: 4 blocks of 16
WAIT_S = 10.0


def _settings(demo_engine, strategy: str) -> ContextSettings:
    return ContextSettings(str(demo_engine), "disaggregated", (), None, None,
                           kv_strategy=strategy, kv_max_size=0, kv_lease_seconds=30.0,
                           stream_interval=1, kv_key_id=key_id(deployment_key()))


@pytest.fixture(params=["direct_transfer", "host_memory"])
def side(request, demo_engine):
    if request.param == "direct_transfer":
        pytest.importorskip("nixl")
    side = PrefillLoop(LLMEngine(demo_engine, num_blocks=16),
                       _settings(demo_engine, request.param), f"hardening_{request.param}")
    yield side
    side.close()


def _request() -> EngineRequest:
    return EngineRequest(PROMPT, SamplingParams(max_tokens=8), True)


def _zero(engine: LLMEngine) -> bool:
    deadline = time.monotonic() + WAIT_S
    while engine.pool.num_used and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.pool.num_used == 0


# ---- context: a failed prefill, a repeated request id ---------------------------------------

def test_a_failed_prefill_gives_its_blocks_back(side, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the runner failed")
    monkeypatch.setattr(side.engine.runner, "prefill", broken)
    answers = prefill(side, [("a", _request()), ("b", _request())])
    assert [str(a) for a in answers] == ["prefill failed: RuntimeError: the runner failed"] * 2
    assert all(isinstance(a, EngineError) for a in answers)
    assert side.engine.pool.num_used == 0
    monkeypatch.undo()
    (out,) = prefill(side, [("c", _request())])             # the instance goes on serving
    assert not isinstance(out, Exception)


def test_a_handoff_whose_device_copy_fails_gives_its_blocks_back(side, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("device copy failed")
    monkeypatch.setattr(side.connector, "stage", broken)
    (out,) = prefill(side, [("a", _request())])
    assert isinstance(out, EngineError) and "device copy failed" in str(out)   # a fault: 500
    assert _zero(side.engine)


def test_a_failed_overlapped_prefill_ends_the_lease_it_took(demo_engine, monkeypatch):
    """The overlapped request's blocks belong to a lease once announced: a prefill failing
    after its first layer ends that lease (blocks back at once, generation told)."""
    pytest.importorskip("nixl")
    from triton_disagg.kv.connector import PoolBuffer
    from triton_disagg.kv.connector_factory import make_connector

    context = PrefillLoop(LLMEngine(demo_engine, num_blocks=16),
                          _settings(demo_engine, "direct_transfer"), "hardening_ovctx")
    generation = LLMEngine(demo_engine, num_blocks=16)
    connector = make_connector("direct_transfer", PoolBuffer(generation.pool.array),
                               "hardening_ovgen", deployment_key(),
                               generation.spec.fingerprint, 30.0)
    try:
        _, listener = connector.listen(len(PROMPT))
        runner_prefill = context.engine.runner.prefill

        def fails_after_a_layer(batch, on_layer=None):
            if on_layer is not None:                   # the overlapped request's batch
                on_layer(0)
            raise RuntimeError("the runner failed at layer 1")
        monkeypatch.setattr(context.engine.runner, "prefill", fails_after_a_layer)
        answers = prefill(context, [("o", _request()), ("p", _request())], [listener, b""])
        assert all("at layer 1" in str(a) for a in answers)
        assert _zero(context.engine) and len(context.connector.endpoint.leases) == 0
        monkeypatch.setattr(context.engine.runner, "prefill", runner_prefill)
    finally:
        connector.close()
        context.close()


def test_a_request_id_repeated_in_one_batch_is_refused_not_handed_off_twice(side):
    first, again, other = prefill(side, [("a", _request()), ("a", _request()),
                                         ("b", _request())])
    assert isinstance(again, RequestError) and "'a' is already in use" in str(again)
    handles = [r["context_phase_params"].tobytes() for r in (first, other)]
    assert len(set(handles)) == 2
    for handle in handles:
        side.release(handle)
    assert _zero(side.engine)
    if side.connector.strategy == "direct_transfer":       # no registration left behind
        assert side.connector.endpoint.agent._exposed == []


# ---- NIXL notifications: each on its own ---------------------------------------------------

@pytest.fixture
def nixl_context():
    """A NIXL sender over a 16-block pool that the test polls, and a stranger's agent
    connected to it; yields ``(endpoint, blocks, stranger, peer)``."""
    pytest.importorskip("nixl")
    from triton_disagg.kv.nixl import NixlEndpoint
    from triton_disagg.kv.nixl_agent import Agent

    blocks = CountingPool()
    endpoint = NixlEndpoint("hardening-ctx", make_pool(1, 16, 4, "float32"), blocks.free,
                            poll_interval_s=None)
    stranger = Agent("hardening-stranger", [])
    handle = _export(endpoint, blocks, [0])
    peer = stranger.connect(endpoint.name, handle.agent_metadata)
    endpoint.leases.release(handle.lease_id)
    yield endpoint, blocks, stranger, peer
    stranger.close()
    endpoint.close()


def _export(endpoint, blocks: CountingPool, ids: list[int]):
    blocks.take(ids)
    return endpoint.export(ids, 4 * len(ids), FP, 30.0)


def test_one_bad_lease_notification_does_not_drop_the_others_of_its_pass(nixl_context):
    from triton_disagg.kv.nixl import NOTIF_PREFIX

    endpoint, blocks, stranger, peer = nixl_context
    leases = [_export(endpoint, blocks, [b]) for b in (1, 2, 3)]
    failing = leases[2].lease_id
    free = endpoint._free_blocks

    def free_blocks(ids):                   # the third lease's release fails
        if ids == [3]:
            raise RuntimeError("free failed")
        free(ids)
    endpoint._free_blocks = free_blocks
    dropped_before = endpoint.dropped.counts.copy()
    for message in (NOTIF_PREFIX + b"\xff\xfe", b"garbage", NOTIF_PREFIX + b"0" * 32,
                    NOTIF_PREFIX + failing.encode(),
                    *(NOTIF_PREFIX + h.lease_id.encode() for h in leases[:2])):
        stranger.notify(peer, message)
    time.sleep(0.2)                         # all of them in one pass
    released, deadline = 0, time.monotonic() + WAIT_S
    while released < 2 and time.monotonic() < deadline:
        stranger.notifs()                   # progresses the stranger's sends
        released += endpoint.poll()
        time.sleep(0.01)
    assert released == 2 and set(blocks.used) == {3} and len(endpoint.leases) == 0
    assert endpoint.dropped.counts - dropped_before == {readers.MALFORMED: 2,
                                                        readers.UNKNOWN_REQUEST: 1}


def test_one_bad_overlap_notification_does_not_drop_the_others_of_its_pass(demo_engine):
    """A signed handle whose agent metadata NIXL cannot load fails its own pull; the next
    notification in the same pass still reaches its pull."""
    pytest.importorskip("nixl")
    from triton_disagg.kv import overlap_wire as wire
    from triton_disagg.kv.connector import PoolBuffer
    from triton_disagg.kv.connector_factory import make_connector
    from triton_disagg.kv.handle import KVHandle, encode

    generation = LLMEngine(demo_engine, num_blocks=16)
    connector = make_connector("direct_transfer", PoolBuffer(generation.pool.array),
                               "hardening_ovgen2", deployment_key(),
                               generation.spec.fingerprint, 30.0)
    try:
        nonces = [connector.listen(len(PROMPT))[0] for _ in range(2)]
        blocks = connector.geometry.blocks_for(len(PROMPT))
        unloadable = encode(KVHandle(
            fingerprint=generation.spec.fingerprint, geometry=connector.geometry,
            num_tokens=len(PROMPT), strategy="direct_transfer", lease_id="ab" * 16,
            lease_seconds=30.0, agent_name="ghost", agent_metadata=b"not NIXL metadata",
            pool_addr=4096, ticket_addr=8192, ticket=1, block_ids=tuple(range(blocks))),
            deployment_key())
        reader = connector._layers
        reader._deliver("ghost", [wire.message(wire.HANDLE, nonces[0], unloadable),
                                  wire.message(wire.FAILED, nonces[1], b"context gone"),
                                  b"garbage", wire.message(wire.LAYERS, "0" * 32, b"1")])
        pulls = reader._pulls
        assert "bad tdov-h notification" in pulls[nonces[0]].failure
        assert pulls[nonces[1]].failure == "context gone"
        assert reader.dropped.counts == {readers.MALFORMED: 1, readers.UNKNOWN_REQUEST: 1}
    finally:
        connector.close()


# ---- NIXL remote agents: pinned while a READ uses them -------------------------------------

def test_a_remote_agent_in_use_is_not_evicted_by_a_small_lru():
    """max_peers 1: a pull open on context A survives a whole fetch from context B (which
    loads B and, unpinned, would evict A), and A's READ then returns A's KV."""
    pytest.importorskip("nixl")
    from triton_disagg.kv.nixl import NixlEndpoint

    blocks_a, blocks_b = CountingPool(), CountingPool()
    endpoint_a = NixlEndpoint("hardening-ctx-a", make_pool(1, 16, 4, "float32"),
                              blocks_a.free, poll_interval_s=0.002)
    endpoint_b = NixlEndpoint("hardening-ctx-b", make_pool(2, 16, 4, "float32"),
                              blocks_b.free, poll_interval_s=0.002)
    receiver = NixlEndpoint("hardening-gen", make_pool(3, 16, 4, "float32"))
    receiver.agent._remotes.max_peers = 1
    try:
        handle_a, handle_b = _export(endpoint_a, blocks_a, [4, 5]), \
            _export(endpoint_b, blocks_b, [6, 7])
        peer_a = receiver.open_pull(handle_a, time.monotonic())
        receiver.fetch(handle_b, [0, 1])                   # B loaded, A stays: it is pinned
        np.testing.assert_array_equal(receiver.pool[[0, 1]], endpoint_b.pool[[6, 7]])
        tickets = np.zeros(16, np.int64)                   # [num_blocks]
        reg = receiver.agent.register(tickets)
        deadline = time.monotonic() + WAIT_S
        receiver.read_layers(peer_a, handle_a, [2, 3], range(0, 2), deadline)
        receiver.confirm(peer_a, handle_a, deadline, tickets)
        receiver.agent.unregister(reg)
        np.testing.assert_array_equal(receiver.pool[[2, 3]], endpoint_a.pool[[4, 5]])
        receiver.agent.unpin(peer_a)
        assert len(receiver.agent._remotes) == 1           # the bound holds once unpinned
    finally:
        receiver.close()
        endpoint_b.close()
        endpoint_a.close()


def test_a_load_refused_at_the_bound_leaves_the_handle_fetchable():
    """A pinned peer at ``2 * max_loads`` refuses the next load (TransferError, "retry"):
    the handle that load was for is not marked fetched, so once the pin ends it is read
    (before: LeaseExpiredError, its blocks held until the lease ran out)."""
    pytest.importorskip("nixl")
    from triton_disagg.kv.nixl_agent import TransferError
    from triton_disagg.kv.nixl import NixlEndpoint

    blocks = CountingPool()
    sender = NixlEndpoint("hardening-bound-ctx", make_pool(1, 16, 4, "float32"), blocks.free,
                          poll_interval_s=0.002)
    receiver = NixlEndpoint("hardening-bound-gen", make_pool(3, 16, 4, "float32"))
    receiver.agent._remotes.max_loads = 1
    try:
        first, second, third = (_export(sender, blocks, [b]) for b in (4, 5, 6))
        peer = receiver.open_pull(first, time.monotonic())        # pinned, 1 load
        receiver.fetch(second, [0])                                # 2 loads while pinned
        with pytest.raises(TransferError, match="retry"):
            receiver.fetch(third, [1])
        receiver.agent.unpin(peer)
        receiver.fetch(third, [1])                                 # the retry reads it
        np.testing.assert_array_equal(receiver.pool[1], sender.pool[6])
    finally:
        receiver.close()
        sender.close()


class FakeNixl:
    """The remote-agent calls of a ``nixl_agent``: metadata is the agent's name."""

    def __init__(self):
        self.loaded: set[str] = set()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.loaded.add(metadata.decode())
        return metadata

    def remove_remote_agent(self, name: str) -> None:
        self.loaded.remove(name)


def test_remote_agents_pinned_wait_for_their_last_unpin():
    from triton_disagg.kv.nixl_agent import RemoteAgents

    now, nixl = [0.0], FakeNixl()
    remotes = RemoteAgents(nixl, max_peers=1, idle_s=10, max_loads=2, clock=lambda: now[0])
    remotes.load("a", b"a", pin=True)
    remotes.load("a", b"a", pin=True)                   # two fetches from a
    remotes.load("b", b"b")                             # a pinned: b is the one evicted
    assert nixl.loaded == {"a"}
    remotes.load("a", b"a")                             # max_loads: no reload while pinned
    now[0] = 100.0
    remotes.load("c", b"c", pin=True)                   # a idle, but pinned: kept
    remotes.forget("a")                                 # its READ failed: goes at last unpin
    assert nixl.loaded == {"a", "c"}
    remotes.unpin("a")
    assert nixl.loaded == {"a", "c"}
    remotes.unpin("a")
    assert nixl.loaded == {"c"}
    remotes.unpin("c")
    assert nixl.loaded == {"c"} and len(remotes) == 1


def test_a_tail_fetch_reads_past_a_descriptor_that_starts_inside_its_run():
    """The receiver loaded lease one (block 3 alone), then fetches only the last block of
    lease two (blocks 1-4, one run: its prefix cache holds the first three). NIXL looks a
    READ's remote range up in the one loaded descriptor with the greatest start at or before
    it with the READ's device id: without an id per lease that was lease one's block 3,
    which does not cover block 4 (NIXL_ERR_NOT_FOUND, a 500 the OpenAPI fuzz test met once
    in a few runs); under lease two's own id (its ticket) it is lease two's run.
    tests/server/test_kv_exchange.py has the same between processes, the peer pinned."""
    pytest.importorskip("nixl")
    from triton_disagg.kv.handle import tail
    from triton_disagg.kv.nixl import NixlEndpoint

    blocks = CountingPool()
    sender = NixlEndpoint("hardening-tail-ctx", make_pool(1, 16, 4, "float32"), blocks.free,
                          poll_interval_s=0.002)
    receiver = NixlEndpoint("hardening-tail-gen", make_pool(3, 16, 4, "float32"))
    try:
        receiver.fetch(_export(sender, blocks, [3]), [0])
        receiver.fetch(tail(_export(sender, blocks, [1, 2, 3, 4]), 3), [5])
        np.testing.assert_array_equal(receiver.pool[5], sender.pool[4])
        receiver.fetch(tail(_export(sender, blocks, [1, 2, 3, 4, 5]), 4), [6])
        np.testing.assert_array_equal(receiver.pool[6], sender.pool[5])
    finally:
        receiver.close()
        sender.close()

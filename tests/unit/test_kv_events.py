"""KV events in vLLM's wire format over real ZeroMQ: our bytes decode with vLLM's own
struct definitions (copied here, the independent reference), a publisher's batches reach
a subscriber over ipc and over tcp with CurveZMQ (a subscriber without the deployment's
key gets nothing), a sequence gap and a restarted publisher are reported, dropped events
show as a gap, and a publisher whose subscriber is gone never blocks the caller."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional, Union

import msgspec
import pytest
import zmq

from triton_disagg.routing import kv_events
from triton_disagg.routing.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                             KVEventBatch, KvEventPublisher, KvEventSubscriber)


# vLLM's definitions (vllm/distributed/kv_events.py, the array_like form; its
# examples/online_serving/kv_events_subscriber.py copies the same), as the reference.
class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class VllmKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                       tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str]


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[Union[VllmBlockStored, VllmBlockRemoved, VllmAllBlocksCleared]]


BIG = 2**64 - 1          # hashes are unsigned 64-bit


def test_our_batch_decodes_with_vllms_structs_field_for_field():
    ours = KVEventBatch(12.5, [BlockStored([1, BIG], None, list(range(8)), 4, None, None),
                               BlockStored([7], BIG, [9, 9, 9, 9], 4, None, None),
                               BlockRemoved([1], None), AllBlocksCleared()], 3)
    theirs = msgspec.msgpack.Decoder(VllmKVEventBatch).decode(kv_events.encode(ours))
    assert theirs.ts == 12.5 and theirs.data_parallel_rank == 3
    first, second, removed, cleared = theirs.events
    assert (first.block_hashes, first.parent_block_hash, first.token_ids, first.block_size,
            first.lora_id, first.medium) == ([1, BIG], None, list(range(8)), 4, None, None)
    assert (second.block_hashes, second.parent_block_hash) == ([7], BIG)
    assert isinstance(removed, VllmBlockRemoved) and removed.block_hashes == [1]
    assert isinstance(cleared, VllmAllBlocksCleared)
    # the raw form: tagged arrays; and byte for byte what vLLM's structs write
    raw = msgspec.msgpack.decode(kv_events.encode(KVEventBatch(1.0, [BlockRemoved([5], None)])))
    assert raw == [1.0, [["BlockRemoved", [5], None]], None]
    assert msgspec.msgpack.encode(theirs) == kv_events.encode(ours)
    # and vLLM's bytes decode with ours
    back = kv_events.decode(msgspec.msgpack.encode(theirs))
    assert back == ours


def test_a_payload_that_is_not_a_batch_is_a_decode_error():
    for payload in (b"", b"\xc1", msgspec.msgpack.encode([1.0, [["Nope", 1]]]),
                    msgspec.msgpack.encode({"ts": 1.0})):
        with pytest.raises(msgspec.DecodeError):
            kv_events.decode(payload)


class Recorder:
    """A subscriber's sink that keeps what it is told."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, KVEventBatch]] = []
        self.gaps: list[tuple[str, int]] = []
        self.restarts: list[str] = []
        self.arrived = threading.Condition()

    def batch(self, address: str, batch: KVEventBatch) -> None:
        with self.arrived:
            self.batches.append((address, batch))
            self.arrived.notify_all()

    def gap(self, address: str, missed: int) -> None:
        self.gaps.append((address, missed))

    def restarted(self, address: str) -> None:
        self.restarts.append(address)

    def events(self) -> list:
        return [e for _, b in self.batches for e in b.events]

    def wait(self, predicate, timeout: float = 10.0) -> bool:
        with self.arrived:
            return self.arrived.wait_for(predicate, timeout)


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def _connected(publisher: KvEventPublisher, sink: Recorder) -> None:
    """Wait for the first heartbeat: the subscription is up (PUB drops what it sends
    before a subscriber joined)."""
    assert sink.wait(lambda: sink.batches, kv_events.HEARTBEAT_SECONDS * 5), "no heartbeat"


@pytest.mark.parametrize("host", [None, "127.0.0.1"], ids=["ipc", "tcp-curve"])
def test_published_events_reach_the_subscriber_in_order(context, host):
    publisher = KvEventPublisher(context, host)
    sink = Recorder()
    subscriber = KvEventSubscriber(context, sink)
    try:
        assert publisher.address.startswith("ipc://" if host is None else "tcp://")
        subscriber.subscribe(publisher.address)
        _connected(publisher, sink)
        publisher.stored([11, 12], None, [1, 2, 3, 4], 2)
        publisher.removed([11])
        publisher.cleared()
        assert sink.wait(lambda: len(sink.events()) == 3)
        stored, removed, cleared = sink.events()
        assert stored == BlockStored([11, 12], None, [1, 2, 3, 4], 2, None, None)
        assert removed == BlockRemoved([11], None) and cleared == AllBlocksCleared()
        assert {a for a, _ in sink.batches} == {publisher.address}
        assert sink.gaps == [] and sink.restarts == []
    finally:
        subscriber.close()
        publisher.close()


def test_a_tcp_subscriber_without_the_deployment_key_gets_nothing(context):
    publisher = KvEventPublisher(context, "127.0.0.1")
    intruder = context.socket(zmq.SUB)
    intruder.setsockopt(zmq.LINGER, 0)
    intruder.setsockopt(zmq.SUBSCRIBE, b"")
    intruder.connect(publisher.address)                  # plain tcp, no CURVE
    try:
        publisher.stored([1], None, [5], 1)
        assert not intruder.poll(int(2.5 * kv_events.HEARTBEAT_SECONDS * 1000))
    finally:
        intruder.close()
        publisher.close()


def _raw_publisher(context) -> tuple[zmq.Socket, str]:
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    return pub, f"tcp://127.0.0.1:{port}"


def test_a_sequence_gap_and_a_restart_are_reported(context, monkeypatch):
    monkeypatch.setattr("triton_disagg.zmq_endpoints.connect",
                        lambda sock, address: sock.connect(address))   # plain tcp here
    pub, address = _raw_publisher(context)
    sink = Recorder()
    subscriber = KvEventSubscriber(context, sink)
    try:
        subscriber.subscribe(address)
        batch = KVEventBatch(0.0, [])
        deadline, probe = time.monotonic() + 10, 0
        while not sink.batches and time.monotonic() < deadline:   # until subscribed
            pub.send_multipart(kv_events.frames(probe, batch))     # in sequence: no gap
            probe += 1
            time.sleep(0.05)
        n = probe                           # the probes still in flight arrive in order first
        for sequence in (n, n + 1, n + 4, n + 5):                   # n+2 and n+3 lost
            pub.send_multipart(kv_events.frames(sequence, batch))
        pub.send_multipart([kv_events.TOPIC, (n + 6).to_bytes(8, "big"), b"\xc1"])  # garbage
        pub.send_multipart(kv_events.frames(0, batch))   # a new publisher at the address
        assert sink.wait(lambda: len(sink.restarts) == 1)
        assert sink.gaps == [(address, 2), (address, 1)]
        assert sink.restarts == [address]
    finally:
        subscriber.close()
        pub.close()


def test_events_dropped_by_a_full_buffer_show_as_a_gap(context):
    publisher = KvEventPublisher(context, None, max_pending=2)
    sink = Recorder()
    subscriber = KvEventSubscriber(context, sink)
    try:
        subscriber.subscribe(publisher.address)
        _connected(publisher, sink)
        for block in range(5):            # faster than the sender's FLUSH_SECONDS pause
            publisher.removed([block])
        assert publisher.dropped >= 1
        assert sink.wait(lambda: sink.gaps, 5), "the drop was not seen"
        assert sink.gaps[0] == (publisher.address, 1)
    finally:
        subscriber.close()
        publisher.close()


def test_a_publisher_whose_subscriber_is_gone_never_blocks(context):
    publisher = KvEventPublisher(context, "127.0.0.1")
    sink = Recorder()
    subscriber = KvEventSubscriber(context, sink)
    subscriber.subscribe(publisher.address)
    _connected(publisher, sink)
    subscriber.close()                               # gone without a word
    tokens = list(range(16))
    started = time.monotonic()
    for block in range(50_000):                      # far past every buffer and HWM
        publisher.stored([block], block - 1, tokens, 16)
    elapsed = time.monotonic() - started
    assert elapsed < 5.0, f"the listener took {elapsed:.1f} s"
    time.sleep(3 * kv_events.FLUSH_SECONDS)
    started = time.monotonic()
    publisher.close()
    assert time.monotonic() - started < 5.0


def test_announced_addresses_are_read_back_bounded_and_checked(tmp_path):
    kv_events.announce(tmp_path, "context_0_1", "tcp://10.0.0.1:5557")
    kv_events.announce(tmp_path, "context_0_0", "ipc:///run/x/kv-events")
    kv_events.announce(tmp_path, "../evil", "http://elsewhere")          # not an address
    kv_events.announce(tmp_path, "long", "tcp://" + "h" * 300)
    assert kv_events.announced(tmp_path) == ("ipc:///run/x/kv-events", "tcp://10.0.0.1:5557")
    assert not list(tmp_path.glob("*.address"))          # the name cannot leave the folder
    assert kv_events.announced(tmp_path / "missing") == ()
    for i in range(kv_events.MAX_PUBLISHERS + 5):
        kv_events.announce(tmp_path, f"g{i:03}", f"tcp://h:{i + 1}")
    assert len(kv_events.announced(tmp_path)) <= kv_events.MAX_PUBLISHERS     # files read


def test_serve_names_the_announced_publishers_in_its_banner(tmp_path, capsys):
    from types import SimpleNamespace

    from triton_disagg.launch.register import served_models
    from triton_disagg.launch.serve_banner import announce
    from triton_disagg.triton.endpoints import Endpoints

    for model, address in (("context", "tcp://10.0.0.1:5557"), ("context_1", "tcp://10.0.0.1:5558")):
        (tmp_path / "repo" / model).mkdir(parents=True)      # each instance's model folder
        kv_events.announce(tmp_path / "repo" / model, f"{model}_0_0", address)
    server = SimpleNamespace(repo=tmp_path / "repo", log_path=tmp_path / "log")
    config = SimpleNamespace(mode="disaggregated", engine="e", decoupled_mode=True,
                             server=lambda role: SimpleNamespace(url="c:1", instances=2))
    served = served_models("context", config, server)
    assert [(m.model, m.kv_events) for m in served] == [
        ("context", ("tcp://10.0.0.1:5557",)), ("context_1", ("tcp://10.0.0.1:5558",))]
    assert served_models("scheduler", config, server) == ()
    addresses = ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558")
    endpoints = Endpoints(host="127.0.0.1", http_port=None, grpc_port=9001, metrics_port=None)
    announce("context", config, endpoints, "c:1", server, None, 8081, addresses)
    assert "  kv events tcp://10.0.0.1:5557, tcp://10.0.0.1:5558" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["ipc", "tcp-port"])
def test_an_instance_publishes_where_its_settings_say_and_announces_it(tmp_path, where):
    from types import SimpleNamespace

    from servers import free_port_run

    base = free_port_run(2)
    settings = SimpleNamespace(kv_events_host=None, kv_events_bind=None, kv_events_port=None) \
        if where == "ipc" else SimpleNamespace(kv_events_host="127.0.0.1",
                                               kv_events_bind="127.0.0.1", kv_events_port=base)
    publisher = kv_events.start_publisher(settings, tmp_path, "context_0_1")
    try:
        if where == "ipc":
            assert publisher.address.startswith("ipc://")
        else:
            assert publisher.address == f"tcp://127.0.0.1:{base + 1}"       # instance 1
        assert kv_events.announced(tmp_path) == (publisher.address,)
    finally:
        publisher.close()

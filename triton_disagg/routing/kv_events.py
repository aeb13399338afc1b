"""KV cache events in vLLM's wire format: what an instance's block pool stored and
evicted, published on a ZeroMQ PUB socket, read by the scheduler's ``kv_aware`` router.

The wire format is vLLM's (``vllm/distributed/kv_events.py``, the array-like form its
``examples/online_serving/kv_events_subscriber.py`` and Dynamo's and llm-d's consumers
decode), so their routers could read ours:

- a multipart message ``[topic, sequence, payload]``: ``topic`` is ``TOPIC``; ``sequence``
  an 8-byte big-endian unsigned count, one per batch and publisher, from 0; ``payload`` a
  msgpack ``KVEventBatch``;
- ``KVEventBatch`` is the array ``[ts, events, data_parallel_rank]`` (``ts`` the
  publisher's wall clock, a float; the rank an int, or nil when unset);
- each event is a tagged array whose first element is its class name:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.
  Block hashes are unsigned 64-bit ints. (vLLM's main has since moved to map-encoded
  structs; this is the array form.)

:class:`KvEventPublisher` is a block pool's events listener (``stored``, ``removed``,
``cleared``). Invariants: a listener call only appends to a bounded buffer under a lock
and never blocks on the network (the engine loop calls it); a sender thread sends one
batch of what is buffered every ``FLUSH_SECONDS``, or an empty batch (a heartbeat) when
nothing happened for ``HEARTBEAT_SECONDS``; a send never waits for a subscriber (PUB drops
what a slow or gone subscriber cannot take); events past ``MAX_PENDING_EVENTS`` are
dropped and counted in :attr:`KvEventPublisher.dropped`, and the next batch skips one
sequence number, so every subscriber sees a gap and knows its view is incomplete.

:class:`KvEventSubscriber` reads any number of publishers, one SUB socket each, on one
thread, and hands each decoded batch to its sink with the publisher's address. Per
publisher it tracks the last sequence number: a number past the next one is a gap
(``sink.gap(address, missed)``), a lower one a restarted publisher (``sink.restarted``),
a payload that does not decode a gap of one. Payloads are bounded by ``MAX_PAYLOAD_BYTES``
(ZeroMQ drops a longer message before it is read).

A model instance that publishes names its address to its server's ``serve`` process
with :func:`announce` (a file in its model's folder of the rendered repository, which
``serve`` renders afresh at every start); ``serve`` reads them with :func:`announced`
once the server is ready, for its banner and its etcd record.

Over tcp both ends are CurveZMQ with the deployment's key (:mod:`triton_disagg.zmq_endpoints`),
like the token sockets; over ipc the socket lives in a directory only its owner can reach.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence

import msgspec
import zmq

from triton_disagg import zmq_endpoints
from triton_disagg.readers import guarded

if TYPE_CHECKING:
    from triton_disagg.config.settings import EngineSettings

TOPIC = b"kv-events"
FLUSH_SECONDS = 0.02            # a batch goes out at most this long after its first event
HEARTBEAT_SECONDS = 1.0         # an empty batch when nothing else was sent this long
MAX_PENDING_EVENTS = 10_000     # events buffered for the sender thread; more are dropped
SEND_HIGH_WATER_MARK = 10_000   # batches ZeroMQ queues per subscriber before dropping
MAX_PAYLOAD_BYTES = 16 << 20    # a longer message is dropped by the subscriber's socket
POLL_MS = 100                   # the subscriber thread's poll, and its reaction to commands
ANNOUNCED = "kv_events"         # the folder, in a model's folder, of its instances' addresses
MAX_PUBLISHERS = 64             # addresses a server names (one per model instance)
MAX_ADDRESS_CHARS = 256
_log = logging.getLogger(__name__)


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of every event (vLLM's name); the tag on the wire is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]             # one per full block, chained from parent_block_hash
    parent_block_hash: int | None       # the block before the first, None at a prompt's start
    token_ids: list[int]                # len(block_hashes) x block_size token ids
    block_size: int                     # tokens per block
    lora_id: int | None                 # no LoRA here: None
    medium: str | None                  # None: the engine's own pool


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode(batch: KVEventBatch, encoder: msgspec.msgpack.Encoder = _ENCODER) -> bytes:
    """``batch`` as msgpack (a thread that encodes on its own passes its own ``encoder``)."""
    return encoder.encode(batch)


def decode(payload: bytes) -> KVEventBatch:
    """The batch in ``payload``; msgspec.DecodeError (a ValueError) when it is not one."""
    return _DECODER.decode(payload)


def frames(sequence: int, batch: KVEventBatch,
           encoder: msgspec.msgpack.Encoder = _ENCODER) -> list[bytes]:
    """The multipart message of batch number ``sequence``."""
    return [TOPIC, sequence.to_bytes(8, "big"), encode(batch, encoder)]


class KvEventPublisher:
    """A block pool's events listener that publishes on a PUB socket bound as
    :func:`triton_disagg.zmq_endpoints.bind` binds (``host`` None: ipc; else tcp with
    CurveZMQ, on ``port`` or a free one). :attr:`address` is what subscribers connect to.
    Module docstring: invariants."""

    def __init__(self, context: zmq.Context, host: str | None, name: str = "kv-events",
                 bind_host: str | None = None, port: int | None = None,
                 data_parallel_rank: int | None = None, max_pending: int = MAX_PENDING_EVENTS):
        self.data_parallel_rank, self.max_pending = data_parallel_rank, max_pending
        self.dropped = 0                 # events dropped because the buffer was full
        self.sent = 0                    # batches sent, heartbeats included
        self._pending: list[KVCacheEvent] = []
        self._skip = False               # events were dropped: the next batch skips a number
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._sequence = 0
        self._socket = context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._endpoint = zmq_endpoints.bind(self._socket, host, name, bind_host, port)
        except BaseException:
            self._socket.close()
            raise
        self.address = self._endpoint.address
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher",
                                        daemon=True)
        self._thread.start()

    # the block pool's listener interface
    def stored(self, block_hashes: list[int], parent_hash: int | None, token_ids: list[int],
               block_size: int) -> None:
        self._add(BlockStored(list(block_hashes), parent_hash, list(token_ids), block_size,
                              None, None))

    def removed(self, block_hashes: list[int]) -> None:
        self._add(BlockRemoved(list(block_hashes), None))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    def close(self) -> None:
        """Send what is buffered, stop the thread, close the socket (dropping what a
        subscriber has not taken) and remove an ipc socket's directory."""
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._socket.close()
        self._endpoint.release()

    def _add(self, event: KVCacheEvent) -> None:
        with self._lock:
            if len(self._pending) >= self.max_pending:
                self.dropped += 1
                self._skip = True
                return
            self._pending.append(event)
        self._wake.set()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()          # this thread's own
        last_sent = time.monotonic()
        try:
            while True:
                woken = self._wake.wait(max(0.0, last_sent + HEARTBEAT_SECONDS
                                            - time.monotonic()))
                if self._stop.is_set():
                    break
                if woken:
                    time.sleep(FLUSH_SECONDS)   # gather what the engine adds meanwhile
                self._wake.clear()              # before taking the buffer: none is missed
                self._send(encoder, heartbeat=True)   # the events, or else a heartbeat
                last_sent = time.monotonic()
            self._send(encoder, heartbeat=False)
        except zmq.ZMQError as exc:      # the context was terminated under it
            _log.warning("kv events: the publisher at %s stopped (%s); events are dropped "
                         "from now on and its subscribers fall back", self.address, exc)

    def _send(self, encoder: msgspec.msgpack.Encoder, heartbeat: bool) -> None:
        """Send one batch of the buffered events (an empty one only when ``heartbeat``)."""
        with self._lock:
            events, self._pending = self._pending, []
            skip, self._skip = self._skip, False
        if not events and not heartbeat and not skip:
            return
        self._sequence += 1 if skip else 0  # dropped events: subscribers see a gap
        batch = KVEventBatch(time.time(), events, self.data_parallel_rank)
        self._socket.send_multipart(frames(self._sequence, batch, encoder), flags=zmq.NOBLOCK)
        self._sequence += 1
        self.sent += 1


class Sink(Protocol):
    """What a :class:`KvEventSubscriber` tells, on its thread, per publisher address."""

    def batch(self, address: str, batch: KVEventBatch) -> None: ...

    def gap(self, address: str, missed: int) -> None:
        """``missed`` batches (at least) never arrived, or one did not decode."""

    def restarted(self, address: str) -> None:
        """The publisher's sequence started over: it is a new process, its cache new."""


class KvEventSubscriber:
    """Reads the publishers at the addresses :meth:`subscribe` names (module docstring).
    :meth:`subscribe` / :meth:`unsubscribe` may be called from any thread; they take
    effect within ``POLL_MS``."""

    def __init__(self, context: zmq.Context, sink: Sink):
        self.context, self.sink = context, sink
        self._wanted: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # a reader: should it die anyway, its instance fails loudly (readers.guarded)
        self._thread = threading.Thread(target=guarded("the KV events subscriber", self._run),
                                        name="kv-events-subscriber", daemon=True)
        self._thread.start()

    def subscribe(self, address: str) -> None:
        with self._lock:
            self._wanted.add(address)

    def unsubscribe(self, address: str) -> None:
        with self._lock:
            self._wanted.discard(address)

    def set_addresses(self, addresses: set[str]) -> None:
        """Subscribe to exactly ``addresses``."""
        with self._lock:
            self._wanted = set(addresses)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        sockets: dict[str, zmq.Socket] = {}
        by_socket: dict[zmq.Socket, str] = {}
        last: dict[str, int] = {}
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                with self._lock:
                    wanted = set(self._wanted)
                for address in [a for a in sockets if a not in wanted]:
                    sock = sockets.pop(address)
                    poller.unregister(sock)
                    del by_socket[sock]
                    last.pop(address, None)
                    sock.close(linger=0)
                for address in wanted - set(sockets):
                    sock = self._open(address)
                    if sock is not None:
                        sockets[address], by_socket[sock] = sock, address
                        poller.register(sock, zmq.POLLIN)
                for sock, _ in poller.poll(POLL_MS) if sockets else self._idle():
                    self._read(by_socket[sock], sock, last)
        finally:
            for sock in sockets.values():
                sock.close(linger=0)

    def _idle(self) -> list:
        self._stop.wait(POLL_MS / 1000)
        return []

    def _open(self, address: str) -> zmq.Socket | None:
        sock = self.context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        try:
            zmq_endpoints.connect(sock, address)
        except zmq.ZMQError as exc:        # an address etcd gave that is no endpoint
            _log.warning("kv events: cannot subscribe to %r (%s)", address[:200], exc)
            sock.close(linger=0)
            return None
        return sock

    def _read(self, address: str, sock: zmq.Socket, last: dict[str, int]) -> None:
        """Every message waiting on ``sock``, in order."""
        while True:
            try:
                parts = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            sequence = int.from_bytes(parts[1], "big") if len(parts) == 3 \
                and len(parts[1]) == 8 else None
            try:
                if sequence is None:
                    raise ValueError("not [topic, 8-byte sequence, payload]")
                batch = decode(parts[2])
            except ValueError:
                self.sink.gap(address, 1)
                if sequence is not None:
                    last[address] = sequence
                continue
            before = last.get(address)
            last[address] = sequence
            if before is not None and sequence <= before:
                self.sink.restarted(address)
            elif before is not None and sequence > before + 1:
                self.sink.gap(address, sequence - before - 1)
            self.sink.batch(address, batch)


def publisher_ports(base: int, urls: Sequence[str], url: str, instances: int) -> range:
    """The tcp ports of the publishers of the server at ``url`` in a pool whose config says
    ``kv_events_port: base``: ``base + j x instances + i`` for its instance i, j its place
    in the role's ``urls`` (0 when it is not listed), so servers sharing a host and a
    config never share a port."""
    place = list(urls).index(url) if url in urls else 0
    return range(base + place * instances, base + (place + 1) * instances)


def start_publisher(settings: "EngineSettings", model_dir: Path, instance: str
                    ) -> KvEventPublisher:
    """Model instance ``instance``'s publisher where its ``settings`` say
    (``kv_events_host`` / ``kv_events_bind``, port ``kv_events_port`` + its index), announced
    in ``model_dir`` (its model's folder: ``args["model_repository"]``) for ``serve``."""
    from triton_disagg.triton.placement import instance_index

    port = settings.kv_events_port
    publisher = KvEventPublisher(zmq.Context.instance(), settings.kv_events_host,
                                 name=f"kv-events-{instance_index(instance)}",
                                 bind_host=settings.kv_events_bind,
                                 port=None if port is None else port + instance_index(instance))
    announce(model_dir, instance, publisher.address)
    return publisher


def kv_events_of(settings: "EngineSettings", args: dict) -> KvEventPublisher | None:
    """The publisher of the Triton model instance that ``args`` (``initialize``'s) names,
    or None when its prefix cache is off (it would have nothing to say)."""
    if not settings.kv_prefix_caching:
        return None
    return start_publisher(settings, Path(args["model_repository"]), args["model_instance_name"])


def announce(model_dir: Path, instance: str, address: str) -> None:
    """Name ``instance``'s publisher ``address`` for :func:`announced` (written whole, then
    renamed, readable by this user alone)."""
    directory = Path(model_dir) / ANNOUNCED
    directory.mkdir(mode=0o700, exist_ok=True)
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in instance)
    partial = directory / f".{name}.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(address)
    partial.rename(directory / f"{name}.address")


def announced(model_dir: Path) -> tuple[str, ...]:
    """The publisher addresses the model's instances announced, sorted; at most
    ``MAX_PUBLISHERS``, each :func:`valid_address` (anything else is left out)."""
    directory = Path(model_dir) / ANNOUNCED
    if not directory.is_dir():
        return ()
    found = []
    for path in sorted(directory.glob("*.address"))[:MAX_PUBLISHERS]:
        with open(path, "rb") as f:
            address = f.read(MAX_ADDRESS_CHARS + 1).decode(errors="replace")
        if valid_address(address):
            found.append(address)
    return tuple(sorted(found))


def valid_address(address: object) -> bool:
    """A ``tcp://`` or ``ipc://`` address of at most ``MAX_ADDRESS_CHARS``."""
    return (isinstance(address, str) and len(address) <= MAX_ADDRESS_CHARS
            and address.startswith(("tcp://", "ipc://")))

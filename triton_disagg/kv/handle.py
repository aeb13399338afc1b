"""The KV handoff's signed handle (``context_phase_params``) and the sender's lease it names.

The handle. The context model returns it as ``UINT8 [-1]``; the generation model takes it
back unchanged. Wire format (version 4: per-lease ticket words)::

    b"TDKV" | uint16 format version | uint32 header length | header JSON | agent metadata
            | HMAC-SHA256 tag (32 bytes) over every byte before it

The header JSON holds every :class:`KVHandle` field except ``agent_metadata`` (the
NIXL agent's partial metadata: connection info and the remote keys of this handle's own
blocks and ticket words, nothing else of the sender's memory), which follows it
verbatim. The tag is keyed by the deployment secret (:mod:`triton_disagg.kv.secret`), so
only a context server of this deployment can make a handle that a generation server of it
accepts.

Invariants: ``decode(encode(h, key), key) == h``; :func:`decode` either returns a handle
whose fields are all valid or raises :class:`HandleError`, never anything else, and it
reads nothing but the prefix before the tag checks out (no JSON parse, no agent metadata
reaches NIXL, no ``shm_name`` reaches the file system unsigned); a handle is at most
``MAX_HANDLE_BYTES``; ``shm_name`` is a plain name in ``/dev/shm`` (``SHM_NAME``); a
handle is only honoured by a generation engine with the same fingerprint
(:func:`check_handle`). A parsed handle's numbers are bounded (defence in depth: only a
server holding the secret signs one): block ids and slots below ``MAX_BLOCK_ID`` (pools
are indexed in int32), ``lease_seconds`` at most ``MAX_LEASE_SECONDS`` (the config
refuses a longer lease), and :func:`check_handle` refuses more tokens than the
receiver's pool holds, which bounds the block count.

The lease. Every handoff grants one over the blocks it exposes (:class:`LeaseTable`, one
per pool, on the sender). The blocks are freed (through the ``free_blocks`` callback) when
the receiver reports it finished reading (:meth:`LeaseTable.release`) or when the lease's
deadline passes (:meth:`LeaseTable.reap`), whichever comes first. Nothing else frees
leased blocks. Every granted lease's blocks are passed to ``free_blocks`` exactly once: a
lease leaves the table under the lock before its callback runs, so a release racing a reap
(or a duplicate notification) finds nothing and frees nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np

from triton_disagg.errors import UserError
from triton_disagg.kv.layout import BlockGeometry

FORMAT_VERSION = 4
MAX_HANDLE_BYTES = 64 * 1024
MAX_LEASE_SECONDS = 3600.0        # kv_cache.lease_seconds at most (config/disagg.py)
MAX_BLOCK_ID = 2**31              # block ids and staging slots are below it
SHM_NAME = re.compile(r"[A-Za-z0-9_-]{1,255}")  # the staging area's own names (triton_disagg.shm)
_MAGIC = b"TDKV"
_PREFIX = struct.Struct(">4sHI")  # magic, format version, header JSON length
_TAG_BYTES = hashlib.sha256().digest_size
_INTS = ("block_ids", "slots")    # header lists of non-negative ints
_TYPES = {"fingerprint": str, "geometry": dict, "num_tokens": int, "strategy": str,
          "lease_id": str, "lease_seconds": (int, float), "agent_name": str, "pool_addr": int,
          "ticket_addr": int, "ticket": int, "block_ids": list, "shm_name": str, "slots": list}


class HandleError(UserError):
    """A ``context_phase_params`` that is garbage, unsigned, from another version or engine."""


@dataclass(frozen=True)
class KVHandle:
    """Where the KV of one prefilled sequence lives and how to fetch it before the deadline.

    ``direct_transfer`` fills ``agent_name``, ``agent_metadata``, ``pool_addr`` (the
    sender's pool, block ``i`` at ``pool_addr + i * geometry.block_nbytes``),
    ``block_ids`` (token order), ``ticket_addr`` (the lease's int64 ticket words, one per
    block of the handle in token order, the ``k``-th at ``ticket_addr + 8 * k``) and
    ``ticket`` (the value every one of those words holds until the lease ends). ``host_memory`` fills ``shm_name`` and ``slots``
    (one staging slot per block, in token order).

    ``lease_seconds`` is relative, never a wall-clock time, so that hosts' clocks need not
    agree: the sender keeps the KV that long from the export, by its own clock; a receiver
    gives up at most that long after it began the fetch, by its own.
    """

    fingerprint: str              # engine fingerprint of the context model
    geometry: BlockGeometry       # the sender's block layout
    num_tokens: int               # tokens of KV in the blocks
    strategy: str                 # "direct_transfer" | "host_memory"
    lease_id: str
    lease_seconds: float          # the lease's length from the export; reclaimed after it
    agent_name: str = ""
    agent_metadata: bytes = b""
    pool_addr: int = 0
    ticket_addr: int = 0
    ticket: int = 0
    block_ids: tuple[int, ...] = ()
    shm_name: str = ""
    slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.strategy not in _WHERE:
            raise ValueError(f"strategy must be one of {tuple(_WHERE)}, got {self.strategy!r}")
        if not isinstance(self.num_tokens, int) or self.num_tokens <= 0:
            raise ValueError(f"num_tokens must be a positive integer, got {self.num_tokens!r}")
        if not self.lease_id or not isinstance(self.lease_seconds, (int, float)) \
                or not 0 < self.lease_seconds <= MAX_LEASE_SECONDS:
            raise ValueError(f"a handle needs a lease id and a lease_seconds in (0, "
                             f"{MAX_LEASE_SECONDS:g}], got {self.lease_seconds!r}")
        for name in _INTS:
            if any(not 0 <= i < MAX_BLOCK_ID for i in getattr(self, name)):
                raise ValueError(f"{name} must be in [0, {MAX_BLOCK_ID})")
        _WHERE[self.strategy](self, self.geometry.blocks_for(self.num_tokens))


def _nixl_fields(handle: KVHandle, blocks: int) -> None:
    if not handle.agent_name or not handle.agent_metadata:
        raise ValueError("direct_transfer handle needs the NIXL agent name and metadata")
    if not (handle.pool_addr > 0 and handle.ticket_addr > 0 and handle.ticket > 0):
        raise ValueError("direct_transfer handle needs pool and ticket addresses and a ticket")
    if len(handle.block_ids) != blocks:
        raise ValueError(f"{handle.num_tokens} tokens need {blocks} block ids, got "
                         f"{handle.block_ids}")


def _staging_fields(handle: KVHandle, blocks: int) -> None:
    if not SHM_NAME.fullmatch(handle.shm_name):
        raise ValueError(f"shm_name {handle.shm_name!r} is not a staging area name (letters, "
                         f"digits, '_' and '-' only)")
    if len(handle.slots) != blocks:
        raise ValueError("host_memory handle needs one staging slot per block")
    int(handle.lease_id, 16)  # host_memory lease ids are the slots' hex ticket


# Where each strategy's KV lives, checked field by field (the names of kv.connector.STRATEGIES).
_WHERE = {"direct_transfer": _nixl_fields, "host_memory": _staging_fields}


@dataclass(frozen=True)
class TransferStats:
    """What one fetch moved, for ``disagg_kv_transfer_bytes_total`` / ``_seconds`` (the
    copy) and ``disagg_kv_fetch_seconds`` (``in_flight_seconds``: from the fetch's start on
    the decode loop to its KV in place, queueing on the fetch thread included)."""

    nbytes: int
    seconds: float
    in_flight_seconds: float = 0.0
    first_token: int | None = None   # an overlapped transfer's: the context's first token
    first_logprob: float = 0.0


def tail(handle: KVHandle, skip: int) -> KVHandle:
    """The handle naming only what follows the first ``skip`` of ``handle``'s blocks (a
    receiver whose prefix cache holds the KV of those): the same lease, its later blocks,
    tickets and staging slots, and the tokens they hold (``skip`` leaves at least one)."""
    blocks = handle.geometry.blocks_for(handle.num_tokens)
    if not 0 <= skip < blocks:
        raise ValueError(f"cannot skip {skip} of the handle's {blocks} blocks")
    return dataclasses.replace(
        handle, num_tokens=handle.num_tokens - skip * handle.geometry.tokens_per_block,
        block_ids=handle.block_ids[skip:], slots=handle.slots[skip:],
        ticket_addr=handle.ticket_addr + 8 * skip if handle.ticket_addr else 0)


def encode(handle: KVHandle, key: bytes) -> bytes:
    """Serialise and sign a handle; :class:`HandleError` if it exceeds ``MAX_HANDLE_BYTES``."""
    fields = dataclasses.asdict(handle)
    metadata = fields.pop("agent_metadata")
    for name in _INTS:
        fields[name] = list(fields[name])
    header = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    body = _PREFIX.pack(_MAGIC, FORMAT_VERSION, len(header)) + header + metadata
    if len(body) + _TAG_BYTES > MAX_HANDLE_BYTES:
        raise HandleError(f"the KV handle for {handle.num_tokens} tokens would be "
                          f"{len(body) + _TAG_BYTES} bytes, over the {MAX_HANDLE_BYTES}-byte "
                          f"limit; raise tokens_per_block")
    return body + _tag(key, body)


def to_tensor(handle: KVHandle, key: bytes) -> np.ndarray:
    """The signed handle as the ``context_phase_params`` output tensor: ``UINT8 [-1]``."""
    return np.frombuffer(encode(handle, key), dtype=np.uint8).copy()


def decode(data: Union[bytes, bytearray, np.ndarray], key: bytes) -> KVHandle:
    """Check and parse a handle from bytes or a ``UINT8`` tensor; :class:`HandleError` on
    anything wrong, including a missing or bad tag, before any of it is parsed."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise HandleError(f"context_phase_params must be UINT8, got {data.dtype.name}")
        data = data.tobytes()
    if not isinstance(data, (bytes, bytearray)):
        raise HandleError(f"context_phase_params must be bytes, got {type(data).__name__}")
    if len(data) > MAX_HANDLE_BYTES:
        raise HandleError(f"context_phase_params is {len(data)} bytes, larger than the "
                          f"{MAX_HANDLE_BYTES} a KV handle may be")
    data = bytes(data)
    if len(data) < _PREFIX.size or data[:4] != _MAGIC:
        raise HandleError(
            "context_phase_params is not a KV handle (bad magic or too short); pass the "
            "context model's context_phase_params output to the generation model unchanged")
    _, version, header_len = _PREFIX.unpack_from(data)
    if version != FORMAT_VERSION:
        raise HandleError(
            f"context_phase_params has handle format version {version}, this server reads "
            f"version {FORMAT_VERSION}; run the same triton-disagg version on context and "
            f"generation servers")
    body, tag = data[:-_TAG_BYTES], data[-_TAG_BYTES:]
    if len(body) < _PREFIX.size or not hmac.compare_digest(tag, _tag(key, body)):
        raise HandleError(
            "context_phase_params: not signed by this deployment (missing or bad HMAC tag); "
            "pass the context model's output unchanged, and give the context and generation "
            "servers the same TRITON_DISAGG_KV_SECRET")
    header_end = _PREFIX.size + header_len
    if header_end > len(body):
        raise HandleError(f"context_phase_params is truncated: header needs {header_end} bytes, "
                          f"got {len(body)}")
    try:
        fields = _fields(json.loads(body[_PREFIX.size:header_end]))
        return KVHandle(agent_metadata=body[header_end:], **fields)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise HandleError(f"context_phase_params is corrupt: {exc}") from None


def _tag(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def _fields(raw: object) -> dict:
    """The header's fields, type-checked, as :class:`KVHandle` keyword arguments."""
    if not isinstance(raw, dict) or set(raw) != set(_TYPES):
        raise ValueError(f"header fields must be {sorted(_TYPES)}")
    for name, kind in _TYPES.items():
        if not isinstance(raw[name], kind) or isinstance(raw[name], bool):
            raise ValueError(f"header field {name} has the wrong type")
    for name in _INTS:
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in raw[name]):
            raise ValueError(f"header field {name} must list integers")
        raw[name] = tuple(raw[name])
    raw["geometry"] = BlockGeometry(**raw["geometry"])
    return raw


def check_handle(handle: KVHandle, fingerprint: str, geometry: BlockGeometry,
                 max_tokens: int) -> None:
    """Refuse a handle this generation engine cannot use, with the reason and the fix.

    ``fingerprint`` and ``geometry`` are the receiver's own engine fingerprint and pool
    geometry, ``max_tokens`` the most tokens its pool holds. Tokens per block and dtype may
    differ (the receiver converts).
    """
    if handle.num_tokens > max_tokens:
        raise HandleError(f"context_phase_params holds {handle.num_tokens} tokens of KV, more "
                          f"than this generation model's pool holds ({max_tokens})")
    if handle.fingerprint != fingerprint:
        raise HandleError(
            f"context_phase_params comes from engine {handle.fingerprint[:16]}, but this "
            f"generation model serves engine {fingerprint[:16]}; load the same engine "
            f"(one `triton-disagg build` output) in the context and generation models")
    if not handle.geometry.same_model(geometry):
        raise HandleError(
            f"context_phase_params KV layout {handle.geometry} does not match this engine's "
            f"{geometry} (layers, KV heads, head size); rebuild both engines from one checkpoint")



class LeaseExpiredError(RuntimeError):
    """The lease ran out before the receiver fetched the blocks; they may be reused."""


@dataclass(frozen=True)
class Lease:
    lease_id: str
    block_ids: tuple[int, ...]
    deadline: float  # wall clock (time.time())
    filling: bool = False   # its blocks are still being prefilled: no reader can finish yet


class LeaseTable:
    """Thread-safe table of live leases over one pool's blocks.

    ``free_blocks(block_ids)`` returns the blocks to the pool; it is called outside the
    table's lock, so it may take the pool's own lock.
    """

    def __init__(self, free_blocks: Callable[[list[int]], None],
                 clock: Callable[[], float] = time.time):
        self._free_blocks = free_blocks
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._expired_total = 0

    def grant(self, block_ids: Sequence[int], ttl_s: float, filling: bool = False) -> Lease:
        """Lease ``block_ids`` for ``ttl_s`` seconds; the table now owns freeing them."""
        lease = Lease(uuid.uuid4().hex, tuple(int(b) for b in block_ids), self._clock() + ttl_s,
                      filling)
        with self._lock:
            self._leases[lease.lease_id] = lease
        return lease

    def release(self, lease_id: str) -> bool:
        """The receiver is done: free the lease's blocks. False if unknown or already gone."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._free_blocks(list(lease.block_ids))
        return True

    def renew(self, lease_id: str, ttl_s: float, filling: bool) -> bool:
        """Move a live lease's deadline to ``ttl_s`` seconds from now, its blocks still being
        filled or now final (an overlapped transfer's prefill). False if unknown or gone."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                self._leases[lease_id] = Lease(lease_id, lease.block_ids,
                                               self._clock() + ttl_s, filling)
        return lease is not None

    def readable(self) -> int:
        """Leases whose blocks are final, so a reader may be about to finish one."""
        with self._lock:
            return sum(not lease.filling for lease in self._leases.values())

    def reap(self, now: Optional[float] = None) -> int:
        """Free every lease whose deadline is before ``now``; returns how many expired."""
        now = self._clock() if now is None else now
        with self._lock:
            expired = [lease for lease in self._leases.values() if lease.deadline < now]
            for lease in expired:
                del self._leases[lease.lease_id]
            self._expired_total += len(expired)
        errors = []
        for lease in expired:  # free them all even if one callback fails
            try:
                self._free_blocks(list(lease.block_ids))
            except Exception as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
        if errors:
            raise errors[0]
        return len(expired)

    @property
    def expired_total(self) -> int:
        """Leases reclaimed by :meth:`reap` so far (``disagg_kv_leases_expired_total``)."""
        with self._lock:
            return self._expired_total

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

"""``context_phase_params``: the opaque, versioned handle naming a KV handoff.

The context model returns it as ``UINT8 [-1]``; the generation model takes it back
unchanged. Wire format (version 1)::

    b"TDKV" | uint16 format version | uint32 header length | header JSON | agent metadata

The header JSON holds every :class:`KVHandle` field except ``agent_metadata`` (the
NIXL agent's raw metadata bytes), which follows it verbatim.

Invariants: ``decode(encode(h)) == h``; :func:`decode` either returns a handle whose
fields are all valid or raises :class:`HandleError`, never anything else; a handle is
only honoured by a generation engine with the same fingerprint (:func:`check_handle`).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from typing import Union

import numpy as np

from triton_disagg.errors import UserError
from triton_disagg.kv.layout import BlockGeometry

FORMAT_VERSION = 1
STRATEGIES = ("direct_transfer", "host_memory")
_MAGIC = b"TDKV"
_PREFIX = struct.Struct(">4sHI")  # magic, format version, header JSON length


class HandleError(UserError):
    """A ``context_phase_params`` that is garbage, from another version, or another engine."""


@dataclass(frozen=True)
class KVHandle:
    """Where the KV of one prefilled sequence lives and how to fetch it before the deadline.

    ``direct_transfer`` fills ``agent_name``, ``agent_metadata`` and ``block_addrs`` (one
    address per block, in token order, each ``geometry.block_nbytes`` long);
    ``host_memory`` fills ``shm_name`` and ``slots`` (one staging slot per block, in token
    order).
    """

    fingerprint: str              # engine fingerprint of the context model
    geometry: BlockGeometry       # the sender's block layout
    num_tokens: int               # tokens of KV in the blocks
    strategy: str                 # "direct_transfer" | "host_memory"
    lease_id: str
    lease_deadline: float         # wall clock (time.time()); blocks may be reclaimed after it
    agent_name: str = ""
    agent_metadata: bytes = b""
    block_addrs: tuple[int, ...] = ()
    shm_name: str = ""
    slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if not isinstance(self.num_tokens, int) or self.num_tokens <= 0:
            raise ValueError(f"num_tokens must be a positive integer, got {self.num_tokens!r}")
        if not self.lease_id or not isinstance(self.lease_deadline, (int, float)):
            raise ValueError("a handle needs a lease id and a numeric lease deadline")
        if self.strategy == "direct_transfer":
            if not self.agent_name or not self.agent_metadata:
                raise ValueError("direct_transfer handle needs the NIXL agent name and metadata")
            if len(self.block_addrs) != self.geometry.blocks_for(self.num_tokens):
                raise ValueError(
                    f"{self.num_tokens} tokens need {self.geometry.blocks_for(self.num_tokens)} "
                    f"block addresses, got {len(self.block_addrs)}")
        elif not self.shm_name or len(self.slots) != self.geometry.blocks_for(self.num_tokens) \
                or min(self.slots) < 0:
            raise ValueError("host_memory handle needs a shared-memory name and one staging "
                             "slot per block")
        else:
            int(self.lease_id, 16)  # host_memory lease ids are the slots' hex ticket


@dataclass(frozen=True)
class TransferStats:
    """What one fetch moved, for ``disagg_kv_transfer_bytes_total`` / ``_seconds``."""

    nbytes: int
    seconds: float


def encode(handle: KVHandle) -> bytes:
    """Serialise a handle to the wire format."""
    fields = dataclasses.asdict(handle)
    metadata = fields.pop("agent_metadata")
    fields["block_addrs"] = list(fields["block_addrs"])
    fields["slots"] = list(fields["slots"])
    header = json.dumps(fields, sort_keys=True).encode()
    return _PREFIX.pack(_MAGIC, FORMAT_VERSION, len(header)) + header + metadata


def to_tensor(handle: KVHandle) -> np.ndarray:
    """The handle as the ``context_phase_params`` output tensor: ``UINT8 [-1]``."""
    return np.frombuffer(encode(handle), dtype=np.uint8).copy()


def decode(data: Union[bytes, bytearray, np.ndarray]) -> KVHandle:
    """Parse a handle from bytes or a ``UINT8`` tensor; :class:`HandleError` on anything wrong."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise HandleError(f"context_phase_params must be UINT8, got {data.dtype.name}")
        data = data.tobytes()
    if not isinstance(data, (bytes, bytearray)):
        raise HandleError(f"context_phase_params must be bytes, got {type(data).__name__}")
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
    header_end = _PREFIX.size + header_len
    if header_end > len(data):
        raise HandleError(f"context_phase_params is truncated: header needs {header_end} bytes, "
                          f"got {len(data)}")
    try:
        fields = json.loads(data[_PREFIX.size:header_end])
        fields["geometry"] = BlockGeometry(**fields["geometry"])
        fields["block_addrs"] = tuple(int(a) for a in fields["block_addrs"])
        fields["slots"] = tuple(int(a) for a in fields["slots"])
        return KVHandle(agent_metadata=data[header_end:], **fields)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise HandleError(f"context_phase_params is corrupt: {exc}") from exc


def check_handle(handle: KVHandle, fingerprint: str, geometry: BlockGeometry) -> None:
    """Refuse a handle this generation engine cannot use, with the reason and the fix.

    ``fingerprint`` and ``geometry`` are the receiver's own engine fingerprint and pool
    geometry. Tokens per block and dtype may differ (the receiver converts).
    """
    if handle.fingerprint != fingerprint:
        raise HandleError(
            f"context_phase_params comes from engine {handle.fingerprint[:16]}, but this "
            f"generation model serves engine {fingerprint[:16]}; load the same engine "
            f"(one `triton-disagg build` output) in the context and generation models")
    if not handle.geometry.same_model(geometry):
        raise HandleError(
            f"context_phase_params KV layout {handle.geometry} does not match this engine's "
            f"{geometry} (layers, KV heads, head size); rebuild both engines from one checkpoint")

"""What crosses the wire for ``--overlap_kv_transfer``: generation's signed *listener*, and
the notifications the context sends it while it prefills.

A listener (``kv_listener``, ``UINT8 [-1]``) is what a generation instance answers an
overlapped request with: its NIXL agent's name, that agent's connection info alone (no
memory keys: nobody is given a way to touch generation's pool) and a random ``nonce``
naming the request, signed with the deployment key like a KV handle::

    b"TDKL" | uint16 version | uint16 name length | name | uint16 nonce length | nonce
            | connection info | HMAC-SHA256 tag over every byte before it

The orchestrator passes it to the context with the prompt. The context then sends that
agent NIXL notifications, each ``<kind>:<nonce>:<payload>``:

- ``HANDLE``: the request's signed KV handle (:mod:`triton_disagg.kv.handle`), sent after
  the prompt's blocks are leased and before the prefill writes them;
- ``LAYERS``: how many layers (from layer 0) of every block are final (``"n"``);
- ``FIRST``: the first token and its log-prob (``"token logprob"``), once every layer is
  in place: generation may decode;
- ``FAILED``: why the context will send nothing more (an error, or the first token already
  finished the request).

Invariants: :func:`decode_listener` returns a listener or raises :class:`HandleError`,
reading nothing before the tag checks out; :func:`parse` returns None for anything that is
not a well-formed notification of this protocol, so a stray message is ignored, never
acted on. A notification is trusted only as far as its nonce (known to the orchestrator
and the context) and, for the KV itself, the handle's own signature.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass
from typing import Optional

from triton_disagg.kv.handle import MAX_HANDLE_BYTES, HandleError

HANDLE, LAYERS, FIRST, FAILED = b"tdov-h", b"tdov-l", b"tdov-f", b"tdov-x"
KINDS = (HANDLE, LAYERS, FIRST, FAILED)
MAX_REASON = 300                     # bytes of a FAILED reason
_MAGIC, _VERSION = b"TDKL", 1
_LEN = struct.Struct(">H")
_TAG_BYTES = hashlib.sha256().digest_size


@dataclass(frozen=True)
class Listener:
    """A generation instance waiting for one request's KV: its agent and contact, and the
    request's nonce."""

    agent_name: str
    contact: bytes
    nonce: str

    @classmethod
    def new(cls, agent_name: str, contact: bytes) -> "Listener":
        return cls(agent_name, contact, secrets.token_hex(16))


def encode_listener(listener: Listener, key: bytes) -> bytes:
    name, nonce = listener.agent_name.encode(), listener.nonce.encode()
    body = (_MAGIC + _LEN.pack(_VERSION) + _LEN.pack(len(name)) + name + _LEN.pack(len(nonce))
            + nonce + listener.contact)
    return body + hmac.new(key, body, hashlib.sha256).digest()


def decode_listener(data: bytes, key: bytes) -> Listener:
    """The listener in ``data``; :class:`HandleError` if it is not one signed by ``key``."""
    if not isinstance(data, (bytes, bytearray)) or not 0 < len(data) <= MAX_HANDLE_BYTES \
            or not bytes(data[:4]) == _MAGIC:
        raise HandleError("kv_listener is not a generation listener; pass generation's "
                          "kv_listener output to the context unchanged")
    body, tag = bytes(data[:-_TAG_BYTES]), bytes(data[-_TAG_BYTES:])
    if not hmac.compare_digest(tag, hmac.new(key, body, hashlib.sha256).digest()):
        raise HandleError("kv_listener: not signed by this deployment (missing or bad HMAC "
                          "tag); give every server the same TRITON_DISAGG_KV_SECRET")
    try:
        at, fields = 4, []
        (version,) = _LEN.unpack_from(body, at)
        at += _LEN.size
        if version != _VERSION:
            raise ValueError(f"version {version}, this server reads {_VERSION}")
        for _ in range(2):
            (n,) = _LEN.unpack_from(body, at)
            fields.append(body[at + _LEN.size:at + _LEN.size + n].decode())
            at += _LEN.size + n
        if not fields[0] or len(fields[1]) != 32 or at > len(body):
            raise ValueError("empty agent name or bad nonce")
        return Listener(fields[0], body[at:], fields[1])
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise HandleError(f"kv_listener is corrupt: {exc}") from None


def message(kind: bytes, nonce: str, payload: bytes = b"") -> bytes:
    return kind + b":" + nonce.encode() + b":" + payload


def parse(msg: bytes) -> Optional[tuple[bytes, str, bytes]]:
    """``(kind, nonce, payload)`` of a notification of this protocol, else None."""
    kind, _, rest = msg.partition(b":")
    nonce, sep, payload = rest.partition(b":")
    if kind not in KINDS or not sep or len(nonce) != 32:
        return None
    try:
        return kind, nonce.decode("ascii"), payload
    except UnicodeDecodeError:
        return None

"""The names of full KV blocks in the prefix cache: a chained 64-bit hash per block.

Block ``i`` of a token sequence (tokens ``i*bs .. (i+1)*bs - 1``) is named by
``blake2b(parent || tokens || fingerprint || salt, digest_size=8)`` read as an unsigned
64-bit integer, where ``parent`` is block ``i-1``'s name (nothing for block 0). A name thus
stands for the whole prefix up to the end of its block, computed by one engine
(``fingerprint``: :func:`cache_fingerprint` of the weights and KV layout) for one tenant
(``salt``: the request's ``cache_salt``; None and ``""`` differ). A KV-aware router calls
:func:`block_hashes` on a request's token ids to name the blocks a server would reuse.

Invariants: only full blocks are named (a partial tail block has no name); equal inputs
give equal names in every process (no per-process hash seed); the encoding is
unambiguous (token ids as fixed 8-byte little-endian words, the salt length-prefixed).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import numpy as np

_NO_SALT = b"\x00"        # no salt given; a given salt is b"\x01" + length + utf-8 bytes


def hash_block(parent: int | None, token_ids: Sequence[int], fingerprint: bytes,
               salt: str | None = None) -> int:
    """The name of one full block of ``token_ids`` following the block named ``parent``
    (None: the first block)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" if parent is None else b"\x01" + struct.pack("<Q", parent))
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    h.update(struct.pack("<I", len(fingerprint)) + fingerprint)
    if salt is None:
        h.update(_NO_SALT)
    else:
        encoded = salt.encode()
        h.update(b"\x01" + struct.pack("<I", len(encoded)) + encoded)
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], tokens_per_block: int, fingerprint: bytes,
                 salt: str | None = None, parent: int | None = None) -> list[int]:
    """One unsigned 64-bit name per FULL block of ``token_ids``, chained from ``parent``
    (None: ``token_ids`` start the sequence; else the name of the block before them)."""
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)              # [n]
    full = len(ids) // tokens_per_block
    names: list[int] = []
    for block in ids[:full * tokens_per_block].reshape(full, tokens_per_block):  # [full, bs]
        parent = hash_block(parent, block, fingerprint, salt)
        names.append(parent)
    return names


def cache_fingerprint(engine_fingerprint: str, tokens_per_block: int, kv_dtype: str) -> bytes:
    """The ``fingerprint`` of an engine's cache: its weights and build (``engine.json``'s
    fingerprint) and the KV layout its pool uses (a different block size or KV dtype never
    shares a name)."""
    return hashlib.sha256(f"{engine_fingerprint}|{tokens_per_block}|{kv_dtype}".encode()
                          ).digest()[:16]

"""What a server publishes in etcd: who it is, what it holds, how busy it is.

JSON, versioned (``"version": 1``), never pickle::

    {"version": 1, "role": "generation", "grpc_url": "gen-01:8001",
     "token_address": "", "nixl_address": "", "fingerprint": "<sha256 hex>",
     "kv_events": ["tcp://gen-01:5557"],
     "models": [{"model": "generation", "kv_events": ["tcp://gen-01:5557"],
                 "load": {"free_kv_blocks": 500, "live_sequences": null,
                          "queued_prompt_tokens": null}}],
     "capacity": {"kv_blocks_total": 512, "tokens_per_block": 16},
     "load": {"free_kv_blocks": 500, "live_sequences": null, "queued_prompt_tokens": null}}

Invariants: :func:`MemberRecord.from_json` reads back what :meth:`to_json` writes and
raises ValueError, with the reason, on anything else: a value over ``MAX_RECORD_BYTES``
(refused before JSON parsing), nesting too deep to parse, a field missing or of the wrong
type, a count outside ``0..MAX_COUNT``, ``tokens_per_block`` not a power of two up to
``MAX_TOKENS_PER_BLOCK``, free KV blocks above the record's own ``kv_blocks_total``. A load
figure the server cannot measure is ``None`` (JSON null), never a made-up 0;
``token_address`` / ``nixl_address`` are "" until the server knows them. ``kv_events``
lists the KV event publishers of the server's model instances
(:mod:`triton_disagg.routing.kv_events`), at most ``MAX_PUBLISHERS`` ``tcp://``
addresses (an ``ipc://`` one would skip CurveZMQ) of at most ``MAX_ADDRESS_CHARS`` characters each; a record without the key
(written before it existed) has none. ``models`` lists the Triton models the scheduler calls
on their own, each with its instances' publishers: a context server of N instances names
N, exactly :func:`~triton_disagg.config.roles.instance_models`'s (``context``,
``context_1``, ...: a record cannot make a scheduler call any other model), at most
``MAX_PUBLISHERS`` with ``MAX_PUBLISHERS`` addresses over them all; a record without the
key (written before it existed) or with an empty list is its role's one model, with the
record's ``kv_events``. A model's ``load`` is its instances' (the record's ``load`` is the
server's, over them all), each figure checked as the server's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from triton_disagg.config.roles import ENGINE_ROLES, Role, instance_models
from triton_disagg.routing.kv_events import MAX_ADDRESS_CHARS, MAX_PUBLISHERS, valid_address

VERSION = 1
MAX_RECORD_BYTES = 16384        # a record is about 500 bytes; longer values are not read
MAX_COUNT = 2**40               # any count a record may carry (blocks, sequences, tokens)
MAX_TOKENS_PER_BLOCK = 2**16


@dataclass(frozen=True)
class Load:
    free_kv_blocks: int | None = None
    live_sequences: int | None = None
    queued_prompt_tokens: int | None = None


@dataclass(frozen=True)
class Loads:
    """A server's load as read now: its own, and each of its record's ``models``' in order
    (() : the models keep theirs)."""

    server: Load
    models: tuple[Load, ...] = ()


@dataclass(frozen=True)
class ModelRecord:
    """One model of a server that a scheduler calls on its own (a context instance)."""

    model: str                        # its Triton model name
    kv_events: tuple[str, ...] = ()   # its model instances' KV event publishers (ZeroMQ)
    load: Load = field(default_factory=Load)   # its model instances' (the server's: summed)


@dataclass(frozen=True)
class MemberRecord:
    role: Role                  # one of ENGINE_ROLES
    grpc_url: str               # "host:port" the scheduler dials
    fingerprint: str            # the engine's fingerprint (engine.json)
    kv_blocks_total: int        # capacity: KV blocks over the server's model instances
    tokens_per_block: int
    token_address: str = ""     # the token channel's ZeroMQ address, if the server has one
    nixl_address: str = ""      # where NIXL reaches its KV pool, if known
    load: Load = field(default_factory=Load)
    kv_events: tuple[str, ...] = ()   # its model instances' KV event publishers (ZeroMQ)
    models: tuple[ModelRecord, ...] = ()   # the models it is called by; (): the role's own

    def with_loads(self, loads: Loads) -> "MemberRecord":
        """This record carrying ``loads``."""
        models = self.models if not loads.models else tuple(
            replace(m, load=load) for m, load in zip(self.models, loads.models, strict=True))
        return replace(self, load=loads.server, models=models)

    def capped(self, max_blocks: int) -> "MemberRecord":
        """This record with its capacity and free KV blocks at most ``max_blocks``."""
        if self.kv_blocks_total <= max_blocks:
            return self
        free = self.load.free_kv_blocks
        return replace(self, kv_blocks_total=max_blocks, load=replace(
            self.load, free_kv_blocks=None if free is None else min(free, max_blocks)))

    def to_json(self) -> bytes:
        return json.dumps({
            "version": VERSION, "role": self.role, "grpc_url": self.grpc_url,
            "token_address": self.token_address, "nixl_address": self.nixl_address,
            "fingerprint": self.fingerprint, "kv_events": list(self.kv_events),
            "models": [{"model": m.model, "kv_events": list(m.kv_events), "load": asdict(m.load)}
                       for m in self.models],
            "capacity": {"kv_blocks_total": self.kv_blocks_total,
                         "tokens_per_block": self.tokens_per_block},
            "load": asdict(self.load)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "MemberRecord":
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError(f"{len(raw)} bytes, over the {MAX_RECORD_BYTES} a record may take")
        try:
            d = json.loads(raw)
        except RecursionError:
            raise ValueError("nested too deep to be a record") from None
        except ValueError as exc:
            raise ValueError(f"not JSON ({exc})") from None
        if not isinstance(d, dict) or d.get("version") != VERSION:
            raise ValueError(f"not a version {VERSION} member record")
        capacity, load = _dict(d, "capacity"), _dict(d, "load")
        role = _str(d, "role")
        if role not in ENGINE_ROLES:
            raise ValueError(f"role {role!r} is not one of {', '.join(ENGINE_ROLES)}")
        record = cls(role=Role(role), grpc_url=_str(d, "grpc_url"),
                     fingerprint=_str(d, "fingerprint"),
                     kv_blocks_total=_int(capacity, "kv_blocks_total"),
                     tokens_per_block=_int(capacity, "tokens_per_block"),
                     token_address=_str(d, "token_address"), nixl_address=_str(d, "nixl_address"),
                     load=_load(load), kv_events=_addresses(d, "kv_events"),
                     models=_models(d, Role(role)))
        tpb = record.tokens_per_block
        if not 0 < tpb <= MAX_TOKENS_PER_BLOCK or tpb & (tpb - 1):
            raise ValueError(f"tokens_per_block {tpb} is not a power of two up to "
                             f"{MAX_TOKENS_PER_BLOCK}")
        for load in (record.load, *(m.load for m in record.models)):
            if (load.free_kv_blocks or 0) > record.kv_blocks_total:
                raise ValueError(f"free_kv_blocks {load.free_kv_blocks} is over its own "
                                 f"kv_blocks_total {record.kv_blocks_total}")
        return record


def _dict(d: dict, key: str) -> dict:
    if not isinstance(d.get(key), dict):
        raise ValueError(f"{key} is not an object")
    return d[key]


def _str(d: dict, key: str) -> str:
    if not isinstance(d.get(key), str):
        raise ValueError(f"{key} is not a string")
    return d[key]


def _addresses(d: dict, key: str) -> tuple[str, ...]:
    value = d.get(key, [])
    if not isinstance(value, list) or len(value) > MAX_PUBLISHERS:
        raise ValueError(f"{key} is not a list of at most {MAX_PUBLISHERS} addresses")
    for address in value:       # tcp only: a server registers its advertised host's, and
        # an ipc:// socket skips CurveZMQ, so a record naming one could feed the router events
        if not valid_address(address) or not address.startswith("tcp://"):
            raise ValueError(f"{key}: {str(address)[:80]!r} is not a tcp:// address "
                             f"of at most {MAX_ADDRESS_CHARS} characters")
    return tuple(value)


def _models(d: dict, role: Role) -> tuple[ModelRecord, ...]:
    """``models`` of record ``d`` (module docstring: what it may hold)."""
    value = d.get("models", [])
    if not isinstance(value, list) or len(value) > MAX_PUBLISHERS:
        raise ValueError(f"models is not a list of at most {MAX_PUBLISHERS} objects")
    if not all(isinstance(m, dict) for m in value):
        raise ValueError("models holds something other than an object")
    names = [m.get("model") for m in value]
    if value and names != list(instance_models(role, len(value))):
        raise ValueError(f"models names {str(names)[:120]}, not the models of a {role} "
                         f"server of {len(value)} instances")
    models = tuple(ModelRecord(name, _addresses(m, "kv_events"), _load(m.get("load", {})))
                   for name, m in zip(names, value))
    if sum(len(m.kv_events) for m in models) > MAX_PUBLISHERS:
        raise ValueError(f"models name more than {MAX_PUBLISHERS} KV event publishers")
    return models


def _load(d: object) -> Load:
    if not isinstance(d, dict):
        raise ValueError("load is not an object")
    return Load(**{k: _int(d, k, optional=True) for k in Load.__dataclass_fields__})


def _int(d: dict, key: str, optional: bool = False) -> int | None:
    value = d.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT:
        raise ValueError(f"{key} is not a whole number from 0 to {MAX_COUNT}")
    return value

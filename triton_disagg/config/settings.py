"""Each model's settings, as :mod:`triton_disagg.triton.render` writes them into the
rendered model's folder (``settings.json``: :func:`write`) and each model's ``initialize``
reads them back (:func:`from_model_config`): one frozen dataclass per model.

Invariants: :func:`to_json` and :func:`from_model_config` are the only places the JSON
is built or read by key; ``from_json(kind, to_json(s)) == s`` for every settings object
``s`` of kind ``kind``; an unknown or missing key fails at load, naming the model. The
settings name the deployment's topology (role urls, etcd endpoint and user, TLS file
paths), so they never go into ``config.pbtxt``, which Triton shows any client
(``GET /v2/models/<model>/config``): the file is readable by the serving user alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Union

from triton_disagg.config.discovery_section import DiscoveryConfig
from triton_disagg.config.roles import Mode, Role
from triton_disagg.config.tls_section import GrpcTLS
from triton_disagg.engine.runtime import Device, DType, Runner


class _OfAMode:
    """Settings of a deployment's ``mode`` (parsed back into a :class:`Mode` at load)."""

    mode: Mode

    @property
    def aggregated(self) -> bool:
        """Generation serves every request whole (``mode: aggregated``): no KV handoff."""
        return self.mode == Mode.AGGREGATED


@dataclass(frozen=True)
class PreprocessSettings(_OfAMode):
    engine: str                        # engine directory (its tokenizer)
    mode: Mode

    def __post_init__(self):
        object.__setattr__(self, "mode", Mode(self.mode))      # settings.json holds its text


@dataclass(frozen=True)
class EngineSettings(_OfAMode):
    """What a context or generation instance needs to build its engine and KV side."""

    engine: str
    mode: Mode
    instance_cpus: tuple[tuple[int, ...], ...]   # cores per instance index; () = unpinned
    tokens_per_block: int | None                 # None: the engine's own layout
    kv_dtype: str | None
    kv_strategy: str                             # kv_cache.strategy
    kv_max_size: int                             # bytes of KV pool per instance (CPU)
    kv_lease_seconds: float
    stream_interval: int
    kv_key_id: str | None = None                 # names the handle-signing key; None: aggregated
    runtime: Runner | None = None                # model.runtime/device/dtype; None: the
    device: Device | None = None                 # serving host's Runtime.default
    dtype: DType | None = None
    kv_gpu_memory_fraction: float = 0.9          # kv_cache.gpu_memory_fraction (CUDA pools)
    kv_max_size_given: bool = False              # kv_max_size was set: it caps a CUDA pool too
    kv_prefix_caching: bool = True               # kv_cache.prefix_caching
    kv_capacity_policy: str = "MAX_UTILIZATION"  # kv_cache.capacity_scheduler_policy
    # Where an instance's KV events publisher binds (routing.kv_events): None: ipc (serve all);
    # else tcp on kv_events_bind (the server's --host), advertising kv_events_host.
    kv_events_host: str | None = None
    kv_events_bind: str | None = None
    kv_events_port: int | None = None            # instance i binds this + i; None: a free one

    def __post_init__(self):
        object.__setattr__(self, "mode", Mode(self.mode))      # settings.json holds its text
        object.__setattr__(self, "instance_cpus", tuple(tuple(c) for c in self.instance_cpus))


@dataclass(frozen=True)
class ContextSettings(EngineSettings):
    pass


@dataclass(frozen=True)
class GenerationSettings(EngineSettings):
    stall_seconds: float = 30.0
    token_host: str | None = None      # None: ipc:// sockets (one server); else tcp:// on it
    token_bind: str | None = None      # bind here, advertise token_host (behind NAT / netns)
    max_local_prefill_length: int = 0  # serve a prompt whose uncached part is at most this


@dataclass(frozen=True)
class PoolSettings:
    urls: tuple[str, ...]
    router: str                        # round_robin | least_loaded | kv_aware
    kv_dtype: str | None = None        # the role's kv_dtype (None: the engine's): kv_aware's hash
    # kv_aware over static urls: the role's tokens_per_block (None: the engine's), and where
    # each server's instances publish KV events (kv_events_port + i, i < instances)
    tokens_per_block: int | None = None
    kv_events_port: int | None = None
    instances: int = 1

    def __post_init__(self):
        object.__setattr__(self, "urls", tuple(self.urls))


@dataclass(frozen=True)
class OrchestratorSettings(_OfAMode):
    engine: str
    mode: Mode
    stall_seconds: float
    token_host: str | None
    transport: str                     # "bls" (serve all) or "grpc" (serve scheduler)
    decoupled: bool
    max_local_prefill_length: int
    pools: dict[Role, PoolSettings] = field(default_factory=dict)   # role -> its pool
    discovery: DiscoveryConfig | None = None
    overlap_kv_transfer: bool = False  # kv_cache.overlap_transfer: generation first (kv.overlap)
    max_concurrent_requests: int = 256  # scheduler_server.max_concurrent_requests, per instance
    grpc_tls: GrpcTLS | None = None     # the config's grpc_tls: calls to the roles over TLS

    def __post_init__(self):
        object.__setattr__(self, "mode", Mode(self.mode))      # settings.json holds its text
        object.__setattr__(self, "pools", {
            Role(role): p if isinstance(p, PoolSettings) else PoolSettings(**p)
            for role, p in self.pools.items()})
        if isinstance(self.discovery, dict):
            object.__setattr__(self, "discovery", DiscoveryConfig(**self.discovery))
        if isinstance(self.grpc_tls, dict):
            object.__setattr__(self, "grpc_tls", GrpcTLS(**self.grpc_tls))


Settings = Union[PreprocessSettings, ContextSettings, GenerationSettings, OrchestratorSettings]
KINDS: dict[str, type] = {"preprocessing": PreprocessSettings, "context": ContextSettings,
                          "generation": GenerationSettings, "orchestrator": OrchestratorSettings}


def to_json(settings: Settings) -> str:
    return json.dumps(asdict(settings), sort_keys=True)


def from_json(model: str, text: str) -> Settings:
    cls = KINDS[model]
    data = json.loads(text)
    names = {f.name for f in fields(cls)}
    if set(data) - names:
        raise ValueError(f"{model} settings: unknown keys {sorted(set(data) - names)}; "
                         f"render the model repository again with this version")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(f"{model} settings: {exc}; render the model repository again") from None


SETTINGS_FILE = "settings.json"


def write(model_dir: Path, settings: Settings) -> None:
    """Write ``settings`` into ``model_dir``, readable and writable by this user alone."""
    fd = os.open(model_dir / SETTINGS_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)          # also when the file was there already
        out.write(to_json(settings))


def read(model: str, model_dir: str | Path) -> Settings:
    """The settings :func:`write` wrote for ``model`` into ``model_dir``."""
    path = Path(model_dir) / SETTINGS_FILE
    try:
        return from_json(model, path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{model} settings: {path} is missing; render the model repository "
                         f"again") from None


def from_model_config(model: str, args: dict) -> Settings:
    """The settings of ``model`` from its ``initialize`` ``args`` (its folder in the
    repository: ``model_repository``)."""
    return read(model, args["model_repository"])

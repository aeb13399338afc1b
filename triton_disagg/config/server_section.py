"""One role's section of ``disagg_config.yaml`` (``context_server``, ``generation_server``,
``scheduler_server``): where its servers are, how its instances are placed, and the keys
that belong to one role alone (:class:`ServerConfig` says which). The whole file's keys
are described in :mod:`triton_disagg.config.disagg`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
# Any here: parsed YAML values, checked where they are read.

from triton_disagg.config.values import count, int_list, mapping, number, parse_url
from triton_disagg.errors import UserError
from triton_disagg.kv.layout import KV_DTYPES

ROUTERS = ("least_loaded", "round_robin", "kv_aware")   # the first is the default
SERVER_KEYS = {"url", "urls", "gpus", "cpus", "instances", "tokens_per_block", "kv_dtype",
               "http_port", "metrics_port", "front_port", "router", "kv_events_port"}
SCHEDULER_KEYS = {"url", "http_port", "grpc_port", "metrics_port", "front_port", "instances",
                  "cpus", "max_concurrent_requests"}
MAX_CONCURRENT_REQUESTS = 256        # per orchestrator instance (scheduler_server)
GENERATION_DEFAULT_INSTANCES = 2     # when generation_server.cpus has room for them


@dataclass(frozen=True)
class ServerConfig:
    """One role's placement. ``instances`` model instances split ``cpus`` evenly
    (contiguous chunks); with ``gpus`` there is one instance per GPU. The scheduler's
    ``cpus`` are the front end's and are shared by its instances, never split."""

    # "host:port": context/generation: the role's gRPC endpoint (where the scheduler dials);
    # scheduler: its HTTP front (where clients call)
    url: str | None = None
    # The static pool, each "host:port"; (url,) when url is given. With one entry, url is it.
    urls: tuple[str, ...] = ()
    gpus: tuple[int, ...] = ()
    cpus: tuple[int, ...] = ()
    instances: int = 1
    tokens_per_block: int | None = None  # None: the engine's KV layout
    kv_dtype: str | None = None
    http_port: int | None = None
    grpc_port: int | None = None        # scheduler_server only (the others': their url's)
    metrics_port: int | None = None
    front_port: int | None = None       # the HTTP front (the scheduler's: OpenAI API; all: /healthz)
    # context/generation: instance i of the j-th server of urls publishes its KV events on
    # tcp port kv_events_port + j x instances + i (routing.kv_events.publisher_ports; vLLM
    # offsets its port per data-parallel rank), so a static pool's kv_aware router knows
    # where to subscribe; None: a free port each, named in the etcd record.
    kv_events_port: int | None = None
    # Streaming: a response every this many decode steps (the first token and the last
    # always go at once). TensorRT-LLM's name; generation_server only.
    stream_interval: int = 1
    # A request whose token stream is silent this long ends in an error (generation is told
    # to stop it); a decode loop stuck this long with work live fails its requests.
    # generation_server only.
    stall_seconds: float = 30.0
    # How the scheduler picks this role's server per request (ROUTERS; routing.router).
    router: str = ROUTERS[0]
    # Prompts of at most this many tokens are prefilled by generation itself, with no
    # handoff (0: never). generation_server only.
    max_local_prefill_length: int = 0
    # Requests one orchestrator instance serves at once; one more is refused (UNAVAILABLE,
    # "busy") at once. scheduler_server only.
    max_concurrent_requests: int = MAX_CONCURRENT_REQUESTS

    @property
    def host(self) -> str | None:
        return self.url.rsplit(":", 1)[0] if self.url else None

    @property
    def port(self) -> int | None:
        return int(self.url.rsplit(":", 1)[1]) if self.url else None

    def instance_cpus(self, index: int) -> tuple[int, ...]:
        """Cores of instance ``index``; empty means not pinned."""
        if not self.cpus:
            return ()
        per = len(self.cpus) // self.instances
        return self.cpus[index * per:(index + 1) * per]


def parse_server(raw: Any, key: str, allowed: set[str]) -> ServerConfig:
    """The ``key`` section (``context_server``, ...) checked, keys limited to ``allowed``."""
    s = mapping(raw, key, allowed)
    urls = _urls(s, key)
    url = urls[0] if len(urls) == 1 else None
    gpus = int_list(s.get("gpus", []), f"{key}.gpus")
    cpus = int_list(s.get("cpus", []), f"{key}.cpus")
    if gpus and (cpus or "instances" in s):
        raise UserError(f"{key}: give either gpus (one instance per GPU) or cpus/instances, not both")
    instances = len(gpus) if gpus else count(s.get("instances", _default_instances(key, cpus)),
                                              f"{key}.instances")
    if cpus and len(cpus) < instances and key != "scheduler_server":   # it shares its cores
        raise UserError(f"{key}.cpus: {len(cpus)} cores for {instances} instances; give at least "
                        f"one core per instance or lower instances")
    tpb = s.get("tokens_per_block")
    if tpb is not None and (not isinstance(tpb, int) or tpb < 1 or tpb & (tpb - 1)):
        raise UserError(f"{key}.tokens_per_block: {tpb!r} must be a power of two, e.g. 16")
    kv_dtype = s.get("kv_dtype")
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise UserError(f"{key}.kv_dtype: {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    ports = {k: s.get(k) for k in ("http_port", "grpc_port", "metrics_port", "front_port",
                                   "kv_events_port")}
    for k, v in ports.items():
        if v is not None and (not isinstance(v, int) or not 0 < v < 65536):
            raise UserError(f"{key}.{k}: {v!r} must be a port number between 1 and 65535")
    publishers = max(1, len(urls)) * instances
    if ports["kv_events_port"] is not None and ports["kv_events_port"] + publishers > 65536:
        raise UserError(f"{key}.kv_events_port: {ports['kv_events_port']} + {publishers} "
                        f"publishers (servers x instances) runs past port 65535; pick a "
                        f"lower one")
    interval = count(s.get("stream_interval", 1), f"{key}.stream_interval",
                      " (1: a response per token)")
    stall = number(s.get("stall_seconds", 30.0), f"{key}.stall_seconds")
    router = s.get("router", ROUTERS[0])
    if router not in ROUTERS:
        raise UserError(f"{key}.router: {router!r} is not one of {', '.join(ROUTERS)}")
    local = s.get("max_local_prefill_length", 0)
    if not isinstance(local, int) or isinstance(local, bool) or local < 0:
        raise UserError(f"{key}.max_local_prefill_length: {local!r} must be a whole number of "
                        f"prompt tokens >= 0 (0: every prompt goes to a context server)")
    cap = count(s.get("max_concurrent_requests", MAX_CONCURRENT_REQUESTS),
                f"{key}.max_concurrent_requests", " (requests an orchestrator instance serves)")
    return ServerConfig(url=url, urls=urls, gpus=gpus, cpus=cpus, instances=instances,
                        tokens_per_block=tpb, kv_dtype=kv_dtype, stream_interval=interval,
                        stall_seconds=stall, router=router, max_local_prefill_length=local,
                        max_concurrent_requests=cap, **ports)


def _default_instances(key: str, cpus: tuple[int, ...]) -> int:
    """Generation runs two instances when it is given two cores or more (their decode loops
    overlap one another's Python work: 1.4-1.5x the tokens at saturation); else one."""
    return GENERATION_DEFAULT_INSTANCES if key == "generation_server" and len(cpus) >= 2 else 1


def _urls(s: dict, key: str) -> tuple[str, ...]:
    """A role's ``url`` or ``urls``, each normalized to "host:port"."""
    if "url" in s and "urls" in s:
        raise UserError(f"{key}: give url (one server) or urls (a pool), not both")
    if "url" in s:
        return (parse_url(s["url"], f"{key}.url"),)
    raw = s.get("urls", [])
    if not isinstance(raw, list) or ("urls" in s and not raw):
        raise UserError(f"{key}.urls: {raw!r} must be a non-empty list of host:port, "
                        f"e.g. [\"ctx-01:8001\", \"ctx-02:8001\"]")
    urls = tuple(parse_url(u, f"{key}.urls", "ctx-01:8001") for u in raw)
    if len(set(urls)) != len(urls):
        raise UserError(f"{key}.urls: {list(raw)!r} lists a server twice; list each once")
    return urls

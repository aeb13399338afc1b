"""TensorRT-LLM's disaggregated config (``trtllm-serve disaggregated -c``), mapped onto ours.

Detected by its keys (:func:`is_trtllm`: any of ``hostname``, ``port``, ``backend``,
``context_servers``, ``generation_servers``, ``disagg_cluster``, none of which ours has)::

    hostname: localhost            # -> scheduler_server.url's host
    port: 8000                     # -> scheduler_server.url's port: the HTTP front's (OpenAI API)
    backend: pytorch               # our engine runs as built: a line says it is ignored
    model: {engine: engines/demo}  # ours, as in our format (or serve --engine)
    context_servers:    {num_instances: 1, urls: ["ctx-01:8001"]}
    generation_servers: {num_instances: 1, urls: ["gen-01:8002"], router: {type: load_balancing}}
    conditional_disagg_config: {max_local_prefill_length: 64}
    disagg_cluster: {cluster_uri: "etcd://etcd:2379", cluster_name: demo}

``hostname`` and ``port`` name the scheduler's HTTP front, as they name trtllm-serve's OpenAI
server (``port`` default 8000, trtllm-serve's); its tritonserver's own ports follow the
deployment's last (:func:`launch.deploy.triton_ports`: 8003-8005 beside context 8001 and
generation 8002).

Per section: ``urls`` (as many as ``num_instances``, as TensorRT-LLM checks) -> ``urls``;
``router.type`` ``round_robin`` -> ``round_robin``, ``load_balancing`` -> ``least_loaded``,
``kv_cache_aware`` and ``conversation`` -> ``kv_aware`` (:mod:`triton_disagg.routing.router`);
``kv_cache_config.tokens_per_block`` -> ``tokens_per_block``; ``kv_cache_config.enable_block_reuse``
-> ``kv_cache.prefix_caching`` (one value for every role: sections that differ turn it off,
with a line); ``tensor_parallel_size`` /
``pipeline_parallel_size`` / ``context_parallel_size`` other than 1 are refused (one model
instance is one device here); our own per-role keys (``cpus``, ``instances``, ...) pass
through. ``conditional_disagg_config.max_local_prefill_length`` goes to generation;
``disagg_cluster`` with an ``etcd://`` uri becomes ``discovery`` (prefix
``/triton-disagg/<cluster_name>``). Our top-level ``model``, ``mode``, ``decoupled_mode``,
``kv_cache``, ``discovery``, ``scheduler_server`` pass through. Every other key is one
line through ``say`` (not supported, ignored); the mapped mapping is then validated as
ours is, so a mistake is still one :class:`UserError` line.
"""

from __future__ import annotations

from typing import Any, Callable
# Any here: parsed YAML values, checked where they are read.

from triton_disagg.config.values import mapping, parse_url
from triton_disagg.errors import UserError

MARKERS = ("hostname", "port", "backend", "context_servers", "generation_servers",
           "disagg_cluster")
OURS_AT_TOP = ("model", "mode", "decoupled_mode", "kv_cache", "discovery", "scheduler_server")
OURS_PER_ROLE = ("cpus", "gpus", "instances", "kv_dtype", "http_port", "metrics_port", "front_port",
                 "stream_interval", "stall_seconds")
ROUTERS = {"round_robin": "round_robin", "load_balancing": "least_loaded",
           "kv_cache_aware": "kv_aware", "conversation": "kv_aware"}
PARALLEL_SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size")
DEFAULT_PORT = 8000              # trtllm-serve's, when the config has hostname alone


def is_trtllm(raw: Any) -> bool:
    """A top-level mapping with any key only TensorRT-LLM's format has."""
    return isinstance(raw, dict) and any(key in raw for key in MARKERS)


def from_trtllm(raw: dict, say: Callable[[str], None]) -> dict:
    """Our config's raw mapping for TensorRT-LLM's ``raw``; ``say`` gets one line per key we
    do not support (then ignore). Raises :class:`UserError` for what cannot be honoured."""
    ours: dict[str, Any] = {key: raw[key] for key in OURS_AT_TOP if key in raw}
    roles = (("context_servers", "context_server"), ("generation_servers", "generation_server"))
    for theirs, key in roles:
        if theirs in raw:
            ours[key] = _servers(raw[theirs], theirs, say)
    if "hostname" in raw or "port" in raw:
        scheduler = dict(_any_mapping(ours.get("scheduler_server"), "scheduler_server"))
        port = raw.get("port", DEFAULT_PORT)
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise UserError(f"port: {port!r} must be a port number between 1 and 65535 (the "
                            f"OpenAI front's, as trtllm-serve's)")
        scheduler.setdefault("url", f"{raw.get('hostname', 'localhost')}:{port}")
        ours["scheduler_server"] = scheduler
    reuse = _block_reuse(raw, [theirs for theirs, _ in roles], say)
    if reuse is not None:
        kv_cache = dict(_any_mapping(ours.get("kv_cache"), "kv_cache"))
        kv_cache.setdefault("prefix_caching", reuse)
        ours["kv_cache"] = kv_cache
    if "conditional_disagg_config" in raw:
        conditional = mapping(raw["conditional_disagg_config"], "conditional_disagg_config",
                              {"max_local_prefill_length"})
        if "max_local_prefill_length" in conditional:
            generation = ours.setdefault("generation_server", {})
            generation["max_local_prefill_length"] = conditional["max_local_prefill_length"]
    if "disagg_cluster" in raw:
        ours["discovery"] = _discovery(raw["disagg_cluster"], say)
    if raw.get("max_retries", 1) != 1:
        say(f"max_retries: {raw['max_retries']!r} not supported; the scheduler retries a dead "
            f"context server's request once and migrates a dead generation server's")
    if "backend" in raw:
        say(f"backend: {raw['backend']!r} ignored; the engine in model.engine runs as built")
    handled = set(MARKERS) | set(OURS_AT_TOP) | {"conditional_disagg_config", "max_retries"}
    for key in raw:
        if key not in handled:
            say(f"{key}: not supported by triton-disagg; ignored")
    return ours


def _servers(raw: Any, where: str, say: Callable[[str], None]) -> dict:
    """One ``context_servers`` / ``generation_servers`` section -> our role's mapping."""
    section = _any_mapping(raw, where)
    role: dict[str, Any] = {key: section[key] for key in OURS_PER_ROLE if key in section}
    urls = section.get("urls")
    if urls is not None:
        if not isinstance(urls, list) or not urls:
            raise UserError(f"{where}.urls: {urls!r} must be a non-empty list of host:port")
        number = section.get("num_instances", len(urls))
        if number != len(urls):
            raise UserError(f"{where}.num_instances: {number!r} but urls lists {len(urls)} "
                            f"servers; give one url per instance")
        role["urls"] = [parse_url(u, f"{where}.urls") for u in urls]
    elif "num_instances" in section:
        say(f"{where}.num_instances: ignored without urls; name the servers in urls "
            f"(or use disagg_cluster with an etcd:// uri)")
    for size in PARALLEL_SIZES:
        if section.get(size, 1) != 1:
            raise UserError(f"{where}.{size}: {section[size]!r} not supported; one model "
                            f"instance runs on one device here (use 1, or leave it out)")
    if "router" in section:
        router = _any_mapping(section["router"], f"{where}.router")
        kind = router.get("type", "round_robin")
        if kind in ROUTERS:
            role["router"] = ROUTERS[kind]
        else:
            say(f"{where}.router.type: {kind!r} not supported; routing least_loaded "
                f"(supported: {', '.join(ROUTERS)})")
    kv_cache = section.get("kv_cache_config") or {}
    if isinstance(kv_cache, dict) and "tokens_per_block" in kv_cache:
        role["tokens_per_block"] = kv_cache["tokens_per_block"]
    known = {"urls", "num_instances", "router", *PARALLEL_SIZES, *OURS_PER_ROLE}
    for key, value in section.items():
        if key == "kv_cache_config" and isinstance(value, dict):
            for sub in value:
                if sub == "free_gpu_memory_fraction":
                    say(f"{where}.kv_cache_config.{sub}: ignored; triton-disagg's is one "
                        f"value for every role: kv_cache.gpu_memory_fraction")
                elif sub not in ("tokens_per_block", "enable_block_reuse"):
                    say(f"{where}.kv_cache_config.{sub}: not supported by triton-disagg; "
                        f"ignored (kv_cache.max_size sizes the block pool)")
        elif key not in known:
            say(f"{where}.{key}: not supported by triton-disagg; ignored")
    return role


def _block_reuse(raw: dict, sections: list[str], say: Callable[[str], None]) -> bool | None:
    """``kv_cache_config.enable_block_reuse`` of the role sections as our one
    ``kv_cache.prefix_caching`` (None: no section sets it; sections that differ: False)."""
    given = {}
    for where in sections:
        kv_cache = (raw.get(where) or {}).get("kv_cache_config") if isinstance(
            raw.get(where), dict) else None
        if isinstance(kv_cache, dict) and "enable_block_reuse" in kv_cache:
            value = kv_cache["enable_block_reuse"]
            if not isinstance(value, bool):
                raise UserError(f"{where}.kv_cache_config.enable_block_reuse: {value!r} must "
                                f"be true or false")
            given[where] = value
    if len(set(given.values())) > 1:
        say(f"kv_cache_config.enable_block_reuse differs between {' and '.join(given)}; "
            f"triton-disagg's is one value for every role: kv_cache.prefix_caching: false")
        return False
    return next(iter(given.values()), None)


def _discovery(raw: Any, say: Callable[[str], None]) -> dict:
    """``disagg_cluster`` -> ``discovery``: etcd only (TensorRT-LLM also takes http:// uris,
    its own cluster storage server, which we do not have)."""
    cluster = _any_mapping(raw, "disagg_cluster")
    uri = str(cluster.get("cluster_uri", ""))
    if not uri.startswith("etcd://"):
        raise UserError(f"disagg_cluster.cluster_uri: {uri!r} not supported; triton-disagg "
                        f"discovers servers through etcd: give \"etcd://HOST:2379\"")
    discovery = {"etcd": parse_url(uri.removeprefix("etcd://"), "disagg_cluster.cluster_uri")}
    if cluster.get("cluster_name"):
        discovery["prefix"] = f"/triton-disagg/{cluster['cluster_name']}"
    for key in cluster:
        if key not in ("cluster_uri", "cluster_name"):
            say(f"disagg_cluster.{key}: not supported by triton-disagg; ignored "
                f"(discovery.ttl_seconds sets the lease)")
    return discovery


def _any_mapping(raw: Any, key: str) -> dict:
    """A section whose keys are checked one by one by the caller (None: empty)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"{key}: expected a mapping, got {raw!r}")
    return raw

"""Load and validate ``disagg_config.yaml``.

The deployment guide's format loads as written, plus the engine path::

    model: {engine: engines/demo}
    context_server:    {url: "context-server-01:8000",    gpus: [0, 1]}
    generation_server: {url: "generation-server-01:8001", gpus: [2, 3]}
    kv_cache: {strategy: direct_transfer, max_size: 2GB}

``model.engine`` may be left out when ``serve --engine DIR`` names the engine
(:func:`load_config`'s ``engine``), so the guide's file loads as written.
Extensions (all optional): ``model.name`` (the served model name: the id the OpenAI
front's ``/v1/models`` lists and its ``model`` field must name, as vLLM's and
trtllm-serve's ``--served-model-name``; default the engine directory's name;
``serve --served-model-name`` replaces it), ``model.runtime: numpy | torch``,
``model.device: cpu | cuda``,
``model.dtype: float32 | bfloat16 | float16`` (left out: chosen on the serving host by
:meth:`triton_disagg.engine.runtime.Runtime.default`; ``device: cuda`` on a host without
a GPU is refused by :func:`~triton_disagg.config.host.check_host`), ``model.tensor_parallel_size: 1`` (nothing
else is supported); ``mode: disaggregated | aggregated``;
``decoupled_mode: true | false`` (TensorRT-LLM's name: the public ``ensemble`` streams,
or answers plain ``infer()`` with one response); per server
``cpus: [0, 1]`` and/or ``instances: N`` in place of ``gpus`` (generation defaults to
two instances when its ``cpus`` name two cores or more, every other role to one),
``tokens_per_block``, ``kv_dtype``, ``http_port``, ``metrics_port``, ``front_port`` (the
port of its HTTP front: ``/healthz``; :mod:`launch.front_process`);
``generation_server.stream_interval`` (decode steps per streamed response),
``generation_server.stall_seconds`` (how long a request's token stream may stay silent
before it ends in an error and generation is told to stop it; default 30); a
``scheduler_server: {url, http_port, grpc_port, metrics_port, front_port, instances, cpus}``
for ``serve scheduler`` (``url``: where clients reach it, its HTTP front, the OpenAI API and
``/v1/inference``, as the guide's ``scheduler-node:8002``; ``front_port`` moves the front
alone; ``http_port`` / ``grpc_port`` / ``metrics_port``: tritonserver's own; defaults
in :mod:`launch.deploy` and :mod:`launch.front_process`; ``instances``: orchestrator
instances, in ``serve all`` too; default 1; ``cpus``: the
front end's cores, in ``serve all`` too: tritonserver's own threads and the
preprocessing and orchestrator stubs, which every orchestrator instance shares, so
they are not split per instance; default :func:`~triton_disagg.config.host.front_cpus`);
``kv_cache.lease_seconds``; a ``front:`` section, the HTTP front's admission caps and
timeouts (:mod:`triton_disagg.config.front_section`); ``kv_cache.gpu_memory_fraction`` (a CUDA
pool's share of the device memory free after the weights; default 0.9; it alone sizes a CUDA
pool unless ``kv_cache.max_size`` is written, which then caps it); ``kv_cache.prefix_caching``
(default true: every instance reuses the KV of cached prompt prefixes);
``kv_cache.capacity_scheduler_policy`` (TensorRT-LLM's name: ``MAX_UTILIZATION``, the
default, takes a request's KV as it grows and preempts the newest request when the pool
runs out; ``GUARANTEED_NO_EVICT`` takes its whole prompt + max_tokens at admission;
:mod:`triton_disagg.engine.scheduler`).
``kv_cache.strategy: host_memory`` is refused when the
context and generation urls name two hosts (see :func:`_check_kv_hosts`). A
``kubernetes:`` section is read by ``launch k8s`` alone
(:mod:`triton_disagg.config.kubernetes`). TensorRT-LLM's disaggregated config
(``hostname``, ``port``, ``context_servers: {num_instances, urls}``, ...) loads too,
mapped onto this format by :mod:`triton_disagg.config.trtllm`. ``serve context|generation
--gpus 0,1`` replaces that role's placement (:func:`~triton_disagg.config.host.with_gpus_flag`).

Pools of servers: ``context_server`` / ``generation_server`` take ``urls: [...]`` (a
static pool; ``url`` stays the way to name one server, and ``url: X`` equals
``urls: [X]``), or a top-level ``discovery: {etcd: "host:2379", prefix:
"/triton-disagg/<name>", ttl_seconds: 10}``: servers register in etcd under that prefix
and the scheduler watches it (:mod:`triton_disagg.routing.discovery`); with ``ca_file``,
``cert_file`` + ``key_file`` (TLS) and ``username`` + ``password_env`` (etcd auth, the
password read from that environment variable) as :class:`DiscoveryConfig` says. With discovery a role
names at most one url: where that server binds, not a pool; the scheduler routes over
what etcd holds. Routing (:mod:`triton_disagg.routing.router`): per role ``router:
least_loaded`` (default), ``round_robin`` or ``kv_aware``; ``generation_server.max_local_prefill_length:
N`` (default 0, off) serves a prompt whole on a generation server (``context_and_generation``,
no KV handoff) when at most N of its tokens are not in that instance's prefix cache, as
trtllm-serve and Dynamo decide it.

Invariants: every value is checked here, so a loaded :class:`DisaggConfig` is
usable as is; every mistake is one :class:`UserError` line naming the key and
the fix; paths are absolute (relative ones resolve against the config file).
Whether GPUs exist is checked by :func:`~triton_disagg.config.host.check_host`, so a config written for a
GPU cluster still loads (and renders) on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
# Any here: parsed YAML values, checked where they are read.

from triton_disagg.config.discovery_section import DiscoveryConfig, parse_discovery
from triton_disagg.config.tls_section import GrpcTLS, parse_grpc_tls
from triton_disagg.config.front_section import FrontConfig, parse_front
from triton_disagg.config.kubernetes import KubernetesConfig, parse_kubernetes
from triton_disagg.config.roles import ENGINE_ROLES, Mode, Role, engine_roles
from triton_disagg.config.server_section import (SCHEDULER_KEYS, SERVER_KEYS, ServerConfig,
                                                 parse_server)
from triton_disagg.config.values import fraction, is_loopback, mapping, number, parse_size
from triton_disagg.engine.runtime import Device, DType, Runner, check_choice
from triton_disagg.engine.scheduler import CapacityPolicy
from triton_disagg.errors import UserError
from triton_disagg.kv.connector import strategy as kv_strategy
from triton_disagg.kv.handle import MAX_LEASE_SECONDS

MAX_MODEL_NAME = 256                # characters of a served model name


@dataclass(frozen=True)
class KVCacheConfig:
    strategy: str = "direct_transfer"
    max_size: int = 2 * 10**9           # bytes, per model instance's block pool
    # max_size was written in the config: on CUDA it then caps the device pool; else
    # gpu_memory_fraction alone sizes it (and max_size bounds only the host staging area)
    max_size_given: bool = False
    lease_seconds: float = 30.0
    gpu_memory_fraction: float = 0.9    # of device memory free after weights (CUDA pools)
    # Generation READs a prompt's KV layer by layer during its prefill (kv.overlap); the
    # guide's --overlap_kv_transfer. What changes is the scheduler's (orchestrator's) flow.
    overlap_transfer: bool = False
    # Reuse the KV of cached prompt prefixes (engine.block_pool); TensorRT-LLM's
    # kv_cache_config.enable_block_reuse.
    prefix_caching: bool = True
    # How much KV a request takes at admission (engine.scheduler.CapacityPolicy).
    capacity_scheduler_policy: str = "MAX_UTILIZATION"


@dataclass(frozen=True)
class DisaggConfig:
    engine: Path
    mode: Mode = Mode.DISAGGREGATED
    context: ServerConfig = field(default_factory=ServerConfig)
    generation: ServerConfig = field(default_factory=ServerConfig)
    scheduler: ServerConfig = field(default_factory=ServerConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    discovery: DiscoveryConfig | None = None   # None: membership is the urls of the config
    decoupled_mode: bool = True         # False: non-decoupled ensemble, plain infer() works
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)   # launch k8s only
    front: FrontConfig = field(default_factory=FrontConfig)   # the HTTP front's limits
    grpc_tls: GrpcTLS | None = None     # None: gRPC in clear (config.tls_section)
    # model.runtime / device / dtype; None: chosen on the serving host (Runtime.default)
    runtime: Runner | None = None
    device: Device | None = None
    dtype: DType | None = None
    model_name: str | None = None       # model.name / --served-model-name; None: the engine's
    source: str = "<defaults>"          # where it was loaded from, for messages

    @property
    def served_model_name(self) -> str:
        """The model id clients send: ``model.name``, else the engine directory's name."""
        return self.model_name or self.engine.name

    @property
    def aggregated(self) -> bool:
        """Generation serves every request whole: no context server, no KV handoff."""
        return self.mode == Mode.AGGREGATED

    @property
    def engine_roles(self) -> tuple[Role, ...]:
        """The engine models this deployment runs (generation alone when aggregated)."""
        return engine_roles(self.mode)

    def server(self, role: str) -> ServerConfig:
        """The section of ``role`` (context, generation or scheduler)."""
        sections: dict[str, ServerConfig] = {Role.CONTEXT: self.context,
                                             Role.GENERATION: self.generation,
                                             Role.SCHEDULER: self.scheduler}
        return sections[role]


def load_config(path: str | Path, engine_here: bool = True,
                engine: Path | None = None) -> DisaggConfig:
    """Read and validate a disagg_config.yaml (see the module docstring). ``engine_here``
    False: ``model.engine`` need not exist on this host (``launch k8s`` renders for a
    cluster whose engine lives in a volume). ``engine`` (``serve --engine``) replaces
    ``model.engine``, which the file may then leave out (and ``model:`` with it)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: config file not found; pass -c with an existing disagg_config.yaml")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}:{where} not valid YAML ({getattr(exc, 'problem', exc)})") from None
    raw = _from_trtllm_format(raw, str(path))
    return parse_config(raw, base_dir=path.parent, source=str(path), engine_here=engine_here,
                        engine=engine)


def with_overlap(config: DisaggConfig, what: str = "--overlap_kv_transfer") -> DisaggConfig:
    """``config`` with ``kv_cache.overlap_transfer`` on (the guide's ``--overlap_kv_transfer``),
    or UserError naming ``what`` and the fix when the deployment cannot overlap."""
    try:
        return _checked_overlap(replace(config, kv_cache=replace(config.kv_cache,
                                                                 overlap_transfer=True)))
    except UserError as exc:
        raise UserError(f"{what}: {exc}") from None


def _checked_overlap(config: DisaggConfig) -> DisaggConfig:
    """Overlap needs a disaggregated deployment whose generation READs the context's pool in
    place, with one KV layout on both roles (a layer range is read as it lies)."""
    if not config.kv_cache.overlap_transfer:
        return config
    if config.aggregated:
        raise UserError("mode aggregated moves no KV between servers: nothing to overlap; "
                        "drop overlap_transfer or use mode disaggregated")
    if not kv_strategy(config.kv_cache.strategy).reads_peer_memory:
        raise UserError(f"overlapping the KV transfer with the prefill needs kv_cache.strategy "
                        f"direct_transfer ({config.kv_cache.strategy} copies a prompt's KV "
                        f"once its prefill is done)")
    for key in ("tokens_per_block", "kv_dtype"):
        ours, theirs = getattr(config.context, key), getattr(config.generation, key)
        if ours != theirs:
            raise UserError(f"overlapping the KV transfer needs one KV layout on both roles, "
                            f"but context_server.{key} is {ours} and generation_server.{key} "
                            f"is {theirs}; give both the same")
    return config


def _from_trtllm_format(raw: Any, source: str) -> Any:
    """TensorRT-LLM's disaggregated config mapped onto ours (:mod:`.trtllm`), one line on
    stderr per key it has and we do not support; ours as is."""
    import sys

    from triton_disagg.config.trtllm import from_trtllm, is_trtllm

    if not is_trtllm(raw):
        return raw
    try:
        return from_trtllm(raw, lambda line: print(f"{source}: {line}", file=sys.stderr,
                                                   flush=True))
    except UserError as exc:
        raise UserError(f"{source}: {exc}") from None


def parse_config(raw: Any, base_dir: Path = Path("."), source: str = "<config>",
                 engine_here: bool = True, engine: Path | None = None) -> DisaggConfig:
    """Validate an already-parsed YAML mapping; messages start with ``source``; ``engine``:
    as :func:`load_config` takes it."""
    try:
        return _parse(raw, base_dir, source, engine_here, engine)
    except UserError as exc:
        raise UserError(f"{source}: {exc}") from None


def default_config(engine: str | Path) -> DisaggConfig:
    """``serve all --engine DIR`` without a config file: one instance per role, no pinning."""
    return parse_config({"model": {"engine": str(engine)}}, source="--engine")


def check_model_name(value: Any, key: str) -> str:
    """``value`` checked as a served model name (``key`` names it in the error): a string of
    1 to ``MAX_MODEL_NAME`` printable characters without spaces, as clients put it in JSON
    and URLs (``/v1/models/{id}``)."""
    if (not isinstance(value, str) or not 0 < len(value) <= MAX_MODEL_NAME
            or not value.isprintable() or any(c.isspace() for c in value)):
        raise UserError(f"{key}: {repr(value)[:40]} must be a name of 1 to {MAX_MODEL_NAME} "
                        f"printable characters without spaces, e.g. deepseek-r1")
    return value


def _parse(raw: Any, base_dir: Path, source: str, engine_here: bool,
           engine_flag: Path | None) -> DisaggConfig:
    top = mapping(raw, "top level", {"model", "mode", "decoupled_mode", "context_server",
                                      "generation_server", "scheduler_server", "kv_cache",
                                      "discovery", "kubernetes", "front", "grpc_tls"})
    model = mapping(top.get("model"), "model", {"engine", "name", "runtime", "device", "dtype",
                                                "tensor_parallel_size"},
                    like="engine: engines/demo")
    check_choice(model.get("runtime"), model.get("device"), model.get("dtype"))
    tp = model.get("tensor_parallel_size", 1)
    if tp != 1:
        raise UserError(f"model.tensor_parallel_size: {tp!r}; only 1 is supported (each "
                        f"instance runs the whole model on one device); remove the key or set 1")
    if "engine" not in model and engine_flag is None:
        raise UserError("model.engine: missing; add `model: {engine: engines/demo}` "
                        "(an engine directory from `triton-disagg build`) or pass --engine DIR")
    engine = engine_flag.resolve() if engine_flag is not None else \
        (base_dir / str(model["engine"])).resolve()
    where = "--engine" if engine_flag is not None else "model.engine"
    name = check_model_name(model["name"], "model.name") if "name" in model else None
    if engine_here and not (engine / "engine.json").is_file():
        raise UserError(f"{where}: {engine} has no engine.json; build it with "
                        f"`triton-disagg build --checkpoint HF_CHECKPOINT_DIR --output {engine}` "
                        f"(the demo: `make demo`), or fix the path")
    mode = top.get("mode", Mode.DISAGGREGATED)
    if mode not in tuple(Mode):
        raise UserError(f"mode: {mode!r} is not one of {', '.join(Mode)}")
    decoupled = top.get("decoupled_mode", True)
    if not isinstance(decoupled, bool):
        raise UserError(f"decoupled_mode: {decoupled!r} must be true (streaming) or false "
                        f"(plain infer(), one response per request)")
    kv_raw = mapping(top.get("kv_cache"), "kv_cache",
                     {"strategy", "max_size", "lease_seconds", "overlap_transfer",
                      "gpu_memory_fraction", "prefix_caching", "capacity_scheduler_policy"})
    overlap = kv_raw.get("overlap_transfer", False)
    prefix_caching = kv_raw.get("prefix_caching", True)
    for key, value in (("overlap_transfer", overlap), ("prefix_caching", prefix_caching)):
        if not isinstance(value, bool):
            raise UserError(f"kv_cache.{key}: {value!r} must be true or false")
    strategy = kv_strategy(kv_raw.get("strategy", "direct_transfer")).name
    kv = KVCacheConfig(strategy=strategy,
                       max_size=parse_size(kv_raw.get("max_size", "2GB"), "kv_cache.max_size"),
                       max_size_given="max_size" in kv_raw,
                       lease_seconds=number(kv_raw.get("lease_seconds", 30.0),
                                             "kv_cache.lease_seconds"),
                       gpu_memory_fraction=fraction(kv_raw.get("gpu_memory_fraction", 0.9),
                                                    "kv_cache.gpu_memory_fraction"),
                       overlap_transfer=overlap, prefix_caching=prefix_caching,
                       capacity_scheduler_policy=capacity_policy(
                           kv_raw.get("capacity_scheduler_policy", "MAX_UTILIZATION")))
    if kv.lease_seconds > MAX_LEASE_SECONDS:
        raise UserError(f"kv_cache.lease_seconds: {kv.lease_seconds:g} is over "
                        f"{MAX_LEASE_SECONDS:g}, the longest lease a KV handle may carry")
    discovery = parse_discovery(top.get("discovery"), base_dir, files_here=engine_here)
    config = DisaggConfig(
        engine=engine, mode=Mode(mode), kv_cache=kv, discovery=discovery, decoupled_mode=decoupled,
        runtime=model.get("runtime"), device=model.get("device"), dtype=model.get("dtype"),
        model_name=name,
        kubernetes=parse_kubernetes(top.get("kubernetes")), source=source,
        front=parse_front(top.get("front")),
        grpc_tls=parse_grpc_tls(top.get("grpc_tls"), base_dir, files_here=engine_here),
        context=parse_server(top.get("context_server"), "context_server", SERVER_KEYS),
        generation=parse_server(top.get("generation_server"), "generation_server",
                                SERVER_KEYS | {"stream_interval", "stall_seconds",
                                           "max_local_prefill_length"}),
        scheduler=parse_server(top.get("scheduler_server"), "scheduler_server", SCHEDULER_KEYS),
    )
    for role in ENGINE_ROLES:
        if discovery is not None and len(config.server(role).urls) > 1:
            raise UserError(f"{role}_server.urls: a static pool and discovery both name the "
                            f"servers; drop urls (servers register in etcd) or drop discovery")
    _check_kv_hosts(config)
    try:
        _checked_overlap(config)
    except UserError as exc:
        raise UserError(f"kv_cache.overlap_transfer: {exc}") from None
    if discovery is not None:
        config = replace(config, discovery=replace(discovery, kv_budget=_kv_budget(config)))
    return config


def _kv_budget(config: DisaggConfig) -> dict[str, int]:
    """Role -> the KV bytes one of its servers holds: ``kv_cache.max_size`` per model instance."""
    return {role: config.kv_cache.max_size * config.server(role).instances
            for role in ENGINE_ROLES}


def capacity_policy(value: Any) -> str:
    """``kv_cache.capacity_scheduler_policy``, checked (one of :class:`CapacityPolicy`)."""
    allowed = [p.value for p in CapacityPolicy]
    if value not in allowed:
        raise UserError(f"kv_cache.capacity_scheduler_policy: {value!r} is not one of "
                        f"{', '.join(allowed)}")
    return value


def _check_kv_hosts(config: DisaggConfig) -> None:
    """host_memory stages the KV cache in one host's /dev/shm: refuse context and generation
    urls that name two hosts (two names, neither loopback; names are not resolved, so two
    names of one host are refused too)."""
    hosts = {u.rsplit(":", 1)[0].lower() for role in ENGINE_ROLES
             for u in config.server(role).urls}
    remote = sorted(h for h in hosts if not is_loopback(h))
    if (kv_strategy(config.kv_cache.strategy).needs_one_host and not config.aggregated
            and config.context.urls and config.generation.urls and len(remote) > 1):
        raise UserError(f"kv_cache.strategy: {config.kv_cache.strategy} needs context and "
                        f"generation on one "
                        f"host (it stages the KV cache in /dev/shm), but their urls name "
                        f"{' and '.join(remote)}; use direct_transfer across hosts")



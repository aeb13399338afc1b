"""Render one role's Triton model repository from the templates in ``model_repo/``.

A template folder holds ``config.pbtxt`` with ``${placeholders}`` and
``1/model.py``. Rendering fills the ``input``/``output`` sections from
:mod:`triton_disagg.protocol` (the single owner of tensor names), the ensemble's
steps and the instance group; beside it goes ``settings.json`` (mode 0600, never in the
config, which Triton shows any client: :mod:`triton_disagg.config.settings`), which
the model's ``initialize`` reads (engine path, CPU pinning per instance: see
:func:`instance_cpus`, KV
settings; for the orchestrator each role's pool, static ``urls`` or etcd ``discovery``,
with its routing policy).

Roles: ``all`` (every model; the orchestrator calls context and generation
through BLS), ``scheduler`` (ensemble, preprocessing, an orchestrator that
reaches the roles over gRPC), ``context``, ``generation``. In aggregated mode no
context model is rendered and the orchestrator asks generation for
``context_and_generation``.

Tokens travel from generation to the orchestrator over ZeroMQ (``token_host`` in
both models' settings): ``ipc://`` sockets when it is None (``all``: one server runs
both), else ``tcp://`` on that address (:func:`triton_disagg.launch.deploy.token_host`
decides it per role).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from string import Template
from typing import Any

from triton_disagg import model_repo, protocol as P
from triton_disagg.config import settings as S
from triton_disagg.config.disagg import DisaggConfig
from triton_disagg.config.server_section import ServerConfig
from triton_disagg.config.host import front_cpus
from triton_disagg.config.roles import ENGINE_ROLES, Role, instance_models

TEMPLATES = Path(model_repo.__file__).resolve().parent   # package data: wheels ship it
FRONT = ("ensemble", "preprocessing", "orchestrator")

_IO = {
    "preprocessing": (P.PREPROCESS_INPUTS, P.PREPROCESS_OUTPUTS),
    "orchestrator": (P.ORCHESTRATOR_INPUTS, P.ORCHESTRATOR_OUTPUTS),
    "context": (P.CONTEXT_INPUTS, P.CONTEXT_OUTPUTS),
    "generation": (P.GENERATION_INPUTS, P.GENERATION_OUTPUTS),
    "ensemble": (P.ENSEMBLE_INPUTS, P.ENSEMBLE_OUTPUTS),
}


def models_for(role: str, config: DisaggConfig) -> tuple[str, ...]:
    """The models ``serve role`` runs: the front's, the engine models, or one of these; a
    context server's one model per instance (:func:`~triton_disagg.config.roles.instance_models`)."""
    return tuple(name for name, _, _ in _rendered(role, config))


def _rendered(role: str, config: DisaggConfig) -> list[tuple[str, str, int | None]]:
    """(model name, its template in ``model_repo/``, the one instance it serves or None for
    all of its role's) for each model of ``role``'s repository."""
    roles: dict[str, tuple[str, ...]] = {
        Role.ALL: FRONT + config.engine_roles, Role.SCHEDULER: FRONT,
        Role.CONTEXT: (Role.CONTEXT,), Role.GENERATION: (Role.GENERATION,)}
    out: list[tuple[str, str, int | None]] = []
    for template in roles[role]:
        if template != Role.CONTEXT:
            out.append((template, template, None))
            continue
        names = instance_models(Role.CONTEXT, config.server(template).instances)
        out += [(name, template, i) for i, name in enumerate(names)]
    return out


def render(role: str, config: DisaggConfig, repo: Path, token_host: str | None = None,
           token_bind: str | None = None, kv_events_host: str | None = None,
           kv_events_port: int | None = None) -> Path:
    """Write the repository for ``role`` into ``repo`` (replacing it) and return it;
    ``kv_events_host``: what the instances' KV event publishers advertise (bound on
    ``token_bind``'s host as well; None: ipc), ``kv_events_port``: the first instance's
    port (None: free ones)."""
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(mode=0o700, parents=True)     # Triton runs what is here: code
    for model, template, instance in _rendered(role, config):
        src, dst = TEMPLATES / template, repo / model
        (dst / "1").mkdir(parents=True)
        if (src / "1" / "model.py").is_file():
            shutil.copy2(src / "1" / "model.py", dst / "1" / "model.py")
        values = _values(template, config, instance)
        text = Template((src / "config.pbtxt").read_text()).substitute(values)
        (dst / "config.pbtxt").write_text(text)
        if template in S.KINDS:
            S.write(dst, settings(template, role, config, token_host, token_bind,
                                  kv_events_host, kv_events_port, instance))
    return repo


def settings(model: str, role: str, config: DisaggConfig, token_host: str | None = None,
             token_bind: str | None = None, kv_events_host: str | None = None,
             kv_events_port: int | None = None, instance: int | None = None) -> S.Settings:
    """What ``model``'s ``initialize`` reads back (parameter ``settings``, :mod:`~.settings`);
    ``instance``: the one instance of its role this model serves (its cores, its KV events
    port ``kv_events_port + instance``), None: every instance (cores by instance index)."""
    engine, mode = str(config.engine), config.mode
    if model == "preprocessing":
        return S.PreprocessSettings(engine, mode)
    if model == "orchestrator":
        return S.OrchestratorSettings(
            engine, mode, stall_seconds=config.generation.stall_seconds, token_host=token_host,
            transport="bls" if role == Role.ALL else "grpc", decoupled=config.decoupled_mode,
            max_local_prefill_length=config.generation.max_local_prefill_length,
            overlap_kv_transfer=config.kv_cache.overlap_transfer,
            max_concurrent_requests=config.scheduler.max_concurrent_requests,
            pools={r: _pool(config.server(r)) for r in ENGINE_ROLES},
            discovery=config.discovery, grpc_tls=config.grpc_tls)
    server = config.server(model)
    cpus = instance_cpus(model, role, config)
    if instance is not None:
        cpus = cpus[instance:instance + 1]
        kv_events_port = None if kv_events_port is None else kv_events_port + instance
    common: dict[str, Any] = dict(   # the fields both roles' settings share (of mixed types)
        engine=engine, mode=mode, instance_cpus=cpus,
        tokens_per_block=server.tokens_per_block, kv_dtype=server.kv_dtype,
        kv_strategy=config.kv_cache.strategy, kv_max_size=config.kv_cache.max_size,
        kv_lease_seconds=config.kv_cache.lease_seconds, stream_interval=server.stream_interval,
        kv_gpu_memory_fraction=config.kv_cache.gpu_memory_fraction,
        kv_max_size_given=config.kv_cache.max_size_given,
        kv_prefix_caching=config.kv_cache.prefix_caching,
        kv_capacity_policy=config.kv_cache.capacity_scheduler_policy,
        runtime=config.runtime, device=config.device, dtype=config.dtype,
        kv_events_host=kv_events_host, kv_events_bind=token_bind if kv_events_host else None,
        kv_events_port=kv_events_port if kv_events_host else None)
    if not config.aggregated:   # the key signing KV handles; never the secret itself
        from triton_disagg.kv.secret import render_key_id

        common.update(kv_key_id=render_key_id())
    if model == "context":
        return S.ContextSettings(**common)
    return S.GenerationSettings(**common, stall_seconds=config.generation.stall_seconds,
                                token_host=token_host, token_bind=token_bind,
                                max_local_prefill_length=config.generation.max_local_prefill_length)


def _pool(server: ServerConfig) -> S.PoolSettings:
    return S.PoolSettings(server.urls, server.router, server.kv_dtype, server.tokens_per_block,
                          server.kv_events_port, server.instances)


def instance_cpus(model: str, role: str, config: DisaggConfig) -> list[list[int]]:
    """The cores each instance of ``model`` (context or generation) pins itself to. An
    instance given none runs on every usable core, as an unpinned one always has, rather
    than on the front end's cores that its stub inherits from a pinned tritonserver
    (:func:`~triton_disagg.config.host.front_cpus`); [] where there is nothing to undo."""
    server, usable = config.server(model), os.sched_getaffinity(0)
    anywhere = sorted(usable) if front_cpus(config, role, usable) else []
    return [list(server.instance_cpus(i)) or anywhere for i in range(server.instances)]


def _values(model: str, config: DisaggConfig, instance: int | None = None) -> dict[str, str]:
    inputs, outputs = _IO[model]
    ragged = model == "context"   # the dynamic batcher may group prompts of any length
    values = {
        "max_batch_size": str(P.MAX_BATCH_SIZE),
        "inputs": _tensors("input", inputs, ragged),
        "outputs": _tensors("output", outputs, False),
    }
    if model in ("context", "generation"):
        values["instance_group"] = _instance_group(config.server(model), instance)
    if model == "ensemble":
        values["steps"] = _ensemble_steps()
    if model == "preprocessing":    # its one instance tokenizes before any cap: bound its queue
        values["max_queue_size"] = str(config.scheduler.max_concurrent_requests
                                       * config.scheduler.instances)
    if model == "orchestrator":
        values["decoupled"] = "true" if config.decoupled_mode else "false"
        values["instances"] = str(config.scheduler.instances)
    return values


def _instance_group(server: ServerConfig, instance: int | None) -> str:
    """Every instance of ``server`` (one per GPU with ``gpus``), or the one ``instance``."""
    if server.gpus:
        chosen = server.gpus if instance is None else server.gpus[instance:instance + 1]
        gpus = ", ".join(str(g) for g in chosen)
        return f"instance_group [ {{ count: 1 kind: KIND_GPU gpus: [ {gpus} ] }} ]"
    count = server.instances if instance is None else 1
    return f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]"


def _tensors(kind: str, specs: tuple[P.TensorSpec, ...], ragged: bool) -> str:
    blocks = []
    for s in specs:
        extra = " optional: true" if s.optional else ""
        if ragged and -1 in s.dims:
            extra += " allow_ragged_batch: true"
        dims = ", ".join(str(d) for d in s.dims)
        blocks.append(f'  {{ name: "{s.name}" data_type: {s.pbtxt_type} dims: [ {dims} ]{extra} }}')
    return f"{kind} [\n" + ",\n".join(blocks) + "\n]"


def _ensemble_steps() -> str:
    """preprocessing -> orchestrator (which detokenizes), wired by name through protocol."""
    pre_out = {s.name for s in P.PREPROCESS_OUTPUTS}
    steps = [
        ("preprocessing", {s.name: s.name for s in P.PREPROCESS_INPUTS},
         {n: f"_{n}" for n in pre_out}),
        ("orchestrator",
         {s.name: (f"_{s.name}" if s.name in pre_out else s.name) for s in P.ORCHESTRATOR_INPUTS},
         {s.name: s.name for s in P.ENSEMBLE_OUTPUTS}),
    ]
    out = []
    for model, inputs, outputs in steps:
        maps = [f'      input_map {{ key: "{k}" value: "{v}" }}' for k, v in sorted(inputs.items())]
        maps += [f'      output_map {{ key: "{k}" value: "{v}" }}' for k, v in sorted(outputs.items())]
        out.append(f'    {{\n      model_name: "{model}"\n      model_version: -1\n'
                   + "\n".join(maps) + "\n    }")
    return "ensemble_scheduling {\n  step [\n" + ",\n".join(out) + "\n  ]\n}"


def _quote(text: str) -> str:
    """A protobuf text-format string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

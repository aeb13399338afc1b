"""``serve context|generation`` with ``discovery`` in the config: the server is
registered in etcd while it serves (:class:`~triton_disagg.routing.discovery.Registration`).

Its record names the gRPC url other hosts dial (:func:`launch.deploy.advertised_url`:
``--advertise HOST:PORT``, else the address it binds), the engine's fingerprint, and its capacity from the config: KV
blocks over the role's model instances and tokens per block, and the KV event publishers
its model instances announced (:func:`triton_disagg.routing.kv_events.announced`), per model
it is called by (a context server: one per instance). Its load, and
each model's, comes from its own metrics endpoint; with metrics off the load stays unknown
(None).

:func:`served_models` says which models a server is called by, with their publishers: what
its record names and its banner shows.

Invariant: a server registers only once it is ready, and is deregistered before it stops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from triton_disagg.config.disagg import DisaggConfig
from triton_disagg.config.roles import ENGINE_ROLES, Role, instance_models

if TYPE_CHECKING:
    from triton_disagg.routing.discovery import ModelRecord


def start_registration(role: str, config: DisaggConfig, endpoints, grpc_url: str,
                       models: tuple[ModelRecord, ...] = ()):
    """Register the ready server, naming the ``models`` it is called by, with their KV event
    publishers; returns the started Registration (close it to deregister)."""
    from triton_disagg.routing.discovery import MemberRecord, Registration
    from triton_disagg.routing.discovery.metrics_load import metrics_load
    from triton_disagg.engine.spec import EngineSpec
    from triton_disagg.engine.block_pool import BlockPool
    from triton_disagg.engine.capacity import kv_layout

    server = config.server(role)
    spec = EngineSpec.load(config.engine)
    layout = kv_layout(spec, server.tokens_per_block, server.kv_dtype)
    blocks = BlockPool.blocks_for_budget(spec.block_geometry(layout), config.kv_cache.max_size)
    record = MemberRecord(role=role, grpc_url=grpc_url, fingerprint=spec.fingerprint,
                          kv_blocks_total=blocks * server.instances,
                          tokens_per_block=layout.tokens_per_block,
                          kv_events=tuple(a for m in models for a in m.kv_events), models=models)
    load = None
    if endpoints.server_metrics_url is not None:
        load = metrics_load(endpoints.server_metrics_url, role, tuple(m.model for m in models))
    return Registration(config.discovery, record, load).start()


def served_models(role: str, config, server) -> tuple[ModelRecord, ...]:
    """The models a scheduler calls this context or generation server by
    (:func:`~triton_disagg.config.roles.instance_models`), each with the KV event publishers
    its model instances announced once loaded; () for the other roles."""
    from triton_disagg.routing.discovery import ModelRecord
    from triton_disagg.routing.kv_events import announced

    if role not in ENGINE_ROLES:
        return ()
    return tuple(ModelRecord(name, announced(server.repo / name))
                 for name in instance_models(Role(role), config.server(role).instances))

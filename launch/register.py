"""``serve context|generation`` with ``discovery`` in the config: the server is
registered in etcd while it serves (:class:`~triton_disagg.discovery.Registration`).

Its record names the gRPC url other hosts dial (``--advertise HOST:PORT``, else the
address it binds), the engine's fingerprint, and its capacity from the config: KV
blocks over the role's model instances and tokens per block. Its load comes from its own
metrics endpoint; with metrics off the load stays unknown (None).

Invariant: a server registers only once it is ready, and is deregistered before it stops.
"""

from __future__ import annotations

from triton_disagg.config import DisaggConfig
from triton_disagg.errors import UserError

ROLES = ("context", "generation")
_ANY = ("0.0.0.0", "::")


def advertised_url(role: str, config: DisaggConfig, endpoints, advertise: str | None) -> str | None:
    """The gRPC url this server registers, or None when it does not register."""
    if config.discovery is None or role not in ROLES:
        if advertise is not None:
            raise UserError("--advertise: only serve context|generation with `discovery` in "
                            "the config registers an address; drop --advertise")
        return None
    if advertise is not None:
        host, _, port = advertise.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(f"--advertise: {advertise!r} is not HOST:PORT; write e.g. "
                            f"gen-01:{endpoints.grpc_port}")
        return advertise
    if endpoints.host in _ANY:
        raise UserError(f"--advertise: serve binds {endpoints.host}, which other hosts cannot "
                        f"dial; pass --advertise HOST:{endpoints.grpc_port} (this host's address)")
    return f"{endpoints.host}:{endpoints.grpc_port}"


def start_registration(role: str, config: DisaggConfig, endpoints, grpc_url: str):
    """Register the ready server; returns the started Registration (close it to deregister)."""
    from triton_disagg.discovery import MemberRecord, Registration
    from triton_disagg.discovery.metrics_load import metrics_load
    from triton_disagg.engine.spec import EngineSpec
    from triton_disagg.kv.block_pool import BlockPool
    from triton_disagg.serving.capacity import kv_layout

    server = config.server(role)
    spec = EngineSpec.load(config.engine)
    layout = kv_layout(spec, server.tokens_per_block, server.kv_dtype)
    blocks = BlockPool.blocks_for_budget(spec.block_geometry(layout), config.kv_cache.max_size)
    record = MemberRecord(role=role, grpc_url=grpc_url, fingerprint=spec.fingerprint,
                          kv_blocks_total=blocks * server.instances,
                          tokens_per_block=layout.tokens_per_block)
    load = None
    if endpoints.metrics_port is not None:
        host = "127.0.0.1" if endpoints.host in _ANY else endpoints.host
        load = metrics_load(f"http://{host}:{endpoints.metrics_port}", role)
    return Registration(config.discovery, record, load).start()

"""Where a tritonserver listens and where its clients reach it: the public ports, and,
behind the front's doors (:mod:`triton_disagg.front.public_door`,
:mod:`triton_disagg.front.http_door`, :mod:`triton_disagg.front.metrics_door`), the loopback
ports tritonserver itself binds.

Invariant: behind a door tritonserver binds ``LOOPBACK`` alone; a wildcard bind is reached
on this host at ``LOOPBACK`` (:func:`reachable`).
"""

from __future__ import annotations

from dataclasses import dataclass

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Endpoints:
    """Where clients reach the server; with inner ports, its gRPC and HTTP are behind the
    public door (:mod:`triton_disagg.front.public_door`) and its metrics behind the metrics
    door (:mod:`triton_disagg.front.metrics_door`): a door answers ``host`` at the public
    port and tritonserver listens on ``LOOPBACK`` at the inner one."""
    host: str                   # bind address
    http_port: int | None       # None: HTTP off
    grpc_port: int
    metrics_port: int | None    # None: metrics off
    inner_grpc_port: int | None = None      # None: no door, tritonserver on grpc_port
    inner_http_port: int | None = None      # set when behind the door with HTTP on
    inner_metrics_port: int | None = None   # None: tritonserver's metrics on metrics_port

    @property
    def behind_door(self) -> bool:
        return self.inner_grpc_port is not None

    @property
    def server_grpc(self) -> tuple[str, int]:
        """(address, port) tritonserver's gRPC binds."""
        if self.behind_door:
            return LOOPBACK, self.inner_grpc_port
        return self.host, self.grpc_port

    @property
    def server_http(self) -> tuple[str, int | None]:
        """(address, port) tritonserver's HTTP binds (port None: HTTP off)."""
        if self.behind_door:
            return LOOPBACK, self.inner_http_port
        return self.host, self.http_port

    @property
    def server_metrics(self) -> tuple[str, int | None]:
        """(address, port) tritonserver's metrics bind (port None: metrics off)."""
        if self.inner_metrics_port is not None:
            return LOOPBACK, self.inner_metrics_port
        return self.host, self.metrics_port

    @property
    def server_metrics_url(self) -> str | None:
        """tritonserver's own metrics, as this host reaches them (None: metrics off): for
        this server's own reads, which no door's cap should stand in the way of."""
        address, port = self.server_metrics
        return None if port is None else f"http://{reachable(address)}:{port}"


def reachable(host: str) -> str:
    """Where this host reaches a socket bound to ``host`` (a wildcard: loopback)."""
    return LOOPBACK if host in ("0.0.0.0", "::") else host

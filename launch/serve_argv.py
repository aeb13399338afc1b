"""The command line that starts one server of a deployment, whoever launches it.

Every launcher writes a role's server as :func:`serve_argv` does: the Kubernetes
manifests (:mod:`.k8s_workloads`), the multi-host test (tests/cluster/test_netns_pools.py) and
the per-host commands of docs/deploy.md. So what the tests run on network-namespace
hosts is, flag for flag, what a pod runs.
"""

from __future__ import annotations

from triton_disagg.config.roles import PLACED_ROLES

PROGRAM = "triton-disagg"


def serve_argv(role: str, config: str, host: str, grpc_port: int, metrics_port: int,
               http_port: int | None = None, advertise: str | None = None,
               front_port: int | None = None) -> list[str]:
    """``triton-disagg serve ROLE -c CONFIG --host HOST --grpc-port P --metrics-port P
    [--http-port P] [--advertise HOST:PORT] [--front-port P]``. ``http_port`` opens Triton's
    HTTP on context and generation, which otherwise serve gRPC and metrics only;
    ``advertise`` is for context and generation alone (serve refuses it on the scheduler);
    ``front_port``: the HTTP front's (``/healthz``; the role's default when None)."""
    if role not in PLACED_ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(PLACED_ROLES)}")
    argv = [PROGRAM, "serve", role, "-c", config, "--host", host,
            "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)]
    if http_port is not None:
        argv += ["--http-port", str(http_port)]
    if advertise is not None:
        argv += ["--advertise", advertise]
    if front_port is not None:
        argv += ["--front-port", str(front_port)]
    return argv

"""The HTTP front's process (:mod:`triton_disagg.front.http_front`), run by every ``serve``
beside tritonserver, answering tritonserver's ports (its doors, below): the whole front
(OpenAI API, ``/v1/inference``, ``/healthz``) for ``serve all`` and ``serve scheduler``; for ``serve context|generation`` its health-only mode
(``/healthz`` and ``/health``: :mod:`triton_disagg.front.health`), and so for ``serve
all|scheduler`` with ``decoupled_mode: false``, since the whole front streams every request
from the decoupled orchestrator.

Port: ``--front-port``, else the role's ``front_port`` in the config (``scheduler_server`` for
``serve all``), else, for all and the scheduler, the port of ``scheduler_server.url`` (where
clients reach the scheduler: the deployment guide's ``scheduler-node:8002``), else
``DEFAULT_FRONT_PORTS``: 8002 for the scheduler (the guide's; its tritonserver's own ports
move out of the way: :func:`launch.deploy.triton_ports`), 8080 for ``serve all`` (its
tritonserver keeps 8000-8002), 8081 for context and 8082 for generation (their fronts answer
``/healthz`` alone), so the roles of one host do not collide. It binds where tritonserver
binds and calls tritonserver's gRPC port on this host. On every role it also answers
Triton's gRPC and HTTP ports, the public door (:mod:`triton_disagg.front.public_door`;
context's and generation's face their peers and cap no calls), and the metrics port, the
metrics door (:mod:`triton_disagg.front.metrics_door`), forwarding to tritonserver on
loopback.
Its admission caps and timeouts are the config's ``front`` section
(:mod:`triton_disagg.config.front_section`), passed as flags.

Invariants: the port is checked free before anything starts (one error line); the process
is serve's child, stopped with the rest (:func:`stop_front`) and watched like a stub (serve
restarts the whole server when it dies); it exits by itself should serve be killed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from triton_disagg.config.disagg import DisaggConfig
from triton_disagg.config.front_section import front_flags
from triton_disagg.config.roles import Role
from triton_disagg.config.tls_section import tls_flags
from triton_disagg.errors import UserError
from triton_disagg.front.health import GATE_ENV
from triton_disagg.triton.endpoints import Endpoints

from .process_group import terminate

DEFAULT_FRONT_PORTS = {"all": 8080, "scheduler": 8002, "context": 8081, "generation": 8082}
STOP_GRACE_SECONDS = 10.0


def front_port(role: str, config: DisaggConfig, flag: int | None) -> int:
    """The front's port for ``serve role``: the flag, the config's key, the scheduler's url
    (all and scheduler), the default (module docstring)."""
    section = config.scheduler if role == Role.ALL else config.server(role)
    url_port = section.port if role in (Role.ALL, Role.SCHEDULER) else None
    return flag or section.front_port or url_port or DEFAULT_FRONT_PORTS[role]


def health_only(role: str, config: DisaggConfig) -> bool:
    """Whether ``serve role`` runs the front's health-only mode (module docstring)."""
    return role not in (Role.ALL, Role.SCHEDULER) or not config.decoupled_mode


def check_front_port(host: str, port: int, endpoints: Endpoints) -> None:
    if port in (endpoints.http_port, endpoints.grpc_port, endpoints.metrics_port):
        raise UserError(f"front port {port} is also tritonserver's; pick another --front-port "
                        f"(or the role's front_port)")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise UserError(f"front port {port} on {host} is not free ({exc.strerror}); stop "
                            f"what uses it or pass --front-port") from None


def start_front(config: DisaggConfig, endpoints: Endpoints, port: int, grpc_url: str,
                work_dir: Path, models: tuple[str, ...] = (), health_only: bool = False,
                gate: Path | None = None, peers: bool = False) -> subprocess.Popen:
    """Start the front on ``endpoints.host:port``, calling tritonserver at ``grpc_url``
    (and, ``endpoints`` behind doors, answering their public ports: :func:`door_flags`); its log
    goes to ``work_dir/http_front.log``. It reports ready while tritonserver and ``models``
    are (the orchestrator always, for the whole front); ``health_only``: its health-only
    mode, else the whole front, whose model id is the config's served model name; ``gate``: a
    scheduler's roles gate file (:mod:`.roles_gate`), which must say ready too; ``peers``:
    the gRPC door faces the deployment's orchestrators (context, generation), so it caps no
    calls (they cap their own)."""
    log = work_dir / "http_front.log"
    mode = ["--health-only"] if health_only else \
        ["--engine", str(config.engine), "--model-name", config.served_model_name]
    cmd = [sys.executable, "-m", "triton_disagg.front.http_front", *mode,
           "--models", ",".join(models), "--grpc-url", grpc_url,
           "--host", endpoints.host, "--port", str(port), "--log", str(log),
           *door_flags(endpoints, peers), *front_flags(config.front),
           *tls_flags(config.grpc_tls)]
    with open(log, "ab") as err:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, env={**os.environ, GATE_ENV: str(gate)} if gate
                                else None)


def door_flags(endpoints: Endpoints, peers: bool = False) -> list[str]:
    """The front's flags for the doors of ``endpoints`` ([] when behind none); ``peers``:
    its gRPC door faces peers and caps no calls."""
    flags = []
    if endpoints.behind_door:
        flags += ["--door-grpc", f"{endpoints.grpc_port}:{endpoints.inner_grpc_port}",
                  *(["--door-peers"] if peers else [])]
        if endpoints.http_port is not None:
            flags += ["--door-http", f"{endpoints.http_port}:{endpoints.inner_http_port}"]
    if endpoints.inner_metrics_port is not None:
        flags += ["--door-metrics", f"{endpoints.metrics_port}:{endpoints.inner_metrics_port}"]
    return flags


def door_ports(endpoints: Endpoints) -> tuple[int, ...]:
    """The public ports of ``endpoints`` that the front's doors answer."""
    behind = ((endpoints.grpc_port, endpoints.behind_door),
              (endpoints.http_port, endpoints.behind_door),
              (endpoints.metrics_port, endpoints.inner_metrics_port is not None))
    return tuple(port for port, doored in behind if doored and port is not None)


def wait_door(proc: subprocess.Popen, host: str, endpoints: Endpoints, timeout: float) -> None:
    """Return once the front's doors (if ``endpoints`` has any) accept connections on
    ``host`` at every public port they answer, so "ready" means reachable; a front that
    exits or ``timeout`` s raises :class:`UserError`."""
    deadline = time.monotonic() + timeout
    for port in door_ports(endpoints):
        while True:
            try:
                socket.create_connection((host, port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise UserError(f"the HTTP front's door did not open port {port}; "
                                    f"see its log (http_front.log in the work directory)")
                time.sleep(0.1)


def stop_front(proc: subprocess.Popen) -> None:
    terminate(proc, STOP_GRACE_SECONDS)

"""The HTTP front's process (:mod:`triton_disagg.front.http_front`), run by ``serve all`` and
``serve scheduler`` beside tritonserver.

Port: ``--front-port``, else ``scheduler_server.front_port``, else ``DEFAULT_FRONT_PORT``
(8080: the deployment guide shows its scheduler on 8002, which here is Triton's metrics
port, and 8000/8001 are Triton's HTTP and gRPC). It binds where tritonserver binds and
calls tritonserver's gRPC port on this host. It needs the decoupled orchestrator (it streams
every request), so with ``decoupled_mode: false`` it is not started.

Invariants: the port is checked free before anything starts (one error line); the process
is serve's child, stopped with the rest (:func:`stop_front`) and watched like a stub (serve
restarts the whole server when it dies); it exits by itself should serve be killed.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from triton_disagg.config.disagg import DisaggConfig
from triton_disagg.errors import UserError
from triton_disagg.triton.tritonserver import Endpoints

from .process_group import terminate

DEFAULT_FRONT_PORT = 8080
STOP_GRACE_SECONDS = 10.0


def front_port(role: str, config: DisaggConfig, flag: int | None) -> int | None:
    """The front's port for ``serve role`` (None: no front for this role or config)."""
    if role not in ("all", "scheduler") or not config.decoupled_mode:
        return None
    return flag or config.scheduler.front_port or DEFAULT_FRONT_PORT


def check_front_port(host: str, port: int, endpoints: Endpoints) -> None:
    if port in (endpoints.http_port, endpoints.grpc_port, endpoints.metrics_port):
        raise UserError(f"front port {port} is also tritonserver's; pick another --front-port "
                        f"(or scheduler_server.front_port)")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise UserError(f"front port {port} on {host} is not free ({exc.strerror}); stop "
                            f"what uses it or pass --front-port") from None


def start_front(config: DisaggConfig, endpoints: Endpoints, port: int, grpc_host: str,
                work_dir: Path) -> subprocess.Popen:
    """Start the front on ``endpoints.host:port``, relaying to ``grpc_host``'s gRPC port;
    its log goes to ``work_dir/http_front.log``. The model id clients send is the engine
    directory's name."""
    log = work_dir / "http_front.log"
    cmd = [sys.executable, "-m", "triton_disagg.front.http_front",
           "--engine", str(config.engine), "--model-name", config.engine.name,
           "--grpc-url", f"{grpc_host}:{endpoints.grpc_port}",
           "--host", endpoints.host, "--port", str(port), "--log", str(log)]
    with open(log, "ab") as err:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err)


def stop_front(proc: subprocess.Popen) -> None:
    terminate(proc, STOP_GRACE_SECONDS)

"""A role's deployment: where it binds, what it renders, the server that runs it.

Binding rule: loopback unless told otherwise. ``--host`` wins; a role served
alone (context / generation / scheduler) binds the host of its ``url`` in the
config; everything else binds 127.0.0.1. The model-control API stays off on every role.

What peers are told (``serve context|generation``): ``--advertise HOST:PORT``, else the
bind address and gRPC port; a wildcard bind (``0.0.0.0``) names no address, so then the
host of the role's ``url``, else ``--advertise`` is required.

Token channel (ZeroMQ, :mod:`triton_disagg.zmq_endpoints`): ``serve all`` uses
``ipc://``. Otherwise the sockets are ``tcp://``: generation's control socket binds
where the server binds (``--host``) and advertises its advertised host (a name or an
address its peers reach); the scheduler's token socket binds and advertises this host's
address on the route toward the generation servers, whatever the scheduler's own front
binds, since every generation server connects to it: the route to the config's
generation urls (each of a pool must leave from the same local address: the socket has
one), else, with discovery, the route to etcd's host, which every server of the
deployment reaches too (127.0.0.1 when that peer is loopback).

Ports (the scheme, README "Ports"; docs/deploy.md says why): clients call the scheduler's
HTTP front (:mod:`.front_process`) on the port of ``scheduler_server.url``, 8002 by
default, the deployment guide's scheduler port. Its tritonserver's own HTTP, gRPC and
metrics ports (flag, else ``scheduler_server.http_port|grpc_port|metrics_port``) default to
the three after the deployment's last port (:func:`triton_ports`): the front's and those of
the context and generation urls, so the guide's three servers (context 8000, generation
8001, scheduler 8002) share one host as written, its tritonserver on 8003-8005, and so do
TensorRT-LLM's (front 8000, context 8001, generation 8002). ``serve all`` alone on a host
keeps Triton's usual 8000 / 8001 / 8002 (tritonclient's and the client CLI's defaults) and
its front on 8080, unless the config names ``scheduler_server.url``: then the scheduler's
scheme. ``serve context|generation`` takes its gRPC port from its ``url`` (that is where
the scheduler dials) and opens HTTP and metrics only when given a port (flag or config).

The doors: on every role the HTTP front's process answers Triton's gRPC and HTTP ports
(:mod:`triton_disagg.front.public_door`, bounding every message: on ``serve all|scheduler``
they are the clients', on ``serve context|generation`` their peers', where Triton would
read a whole message before a model checks the peer credential) and the metrics port
(Prometheus scrapes it, Kubernetes probes it: the metrics door,
:mod:`triton_disagg.front.metrics_door`, a GET with no body); tritonserver listens on
loopback on ports picked free (:func:`behind_door`).
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, replace
from pathlib import Path

from triton_disagg.config.disagg import DisaggConfig
from triton_disagg.config.host import front_cpus
from triton_disagg.config.roles import ENGINE_ROLES, Role
from triton_disagg.config.values import is_loopback
from triton_disagg.errors import UserError

from .front_process import front_port
from .work_dir import refuse_replaceable
from triton_disagg.triton import private_shm
from triton_disagg.triton.render import render
from triton_disagg.triton.stub_check import check_stub
from triton_disagg.triton.tritonserver import TritonServer, locate, server_env
from triton_disagg.triton.endpoints import Endpoints

DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}   # serve all's tritonserver
TRITON_KINDS = ("http", "grpc", "metrics")      # in the order they follow the last port
MAX_PORT = 65535
LOWEST_PICKED_PORT = 20000      # free_port_run picks from here up to the ephemeral range
WILDCARDS = ("0.0.0.0", "::")


@dataclass(frozen=True)
class PortFlags:
    host: str | None = None
    http: int | None = None
    grpc: int | None = None
    metrics: int | None = None
    advertise: str | None = None        # host:port, checked
    front: int | None = None            # --front-port


def triton_ports(role: str, config: DisaggConfig, front: int) -> dict[str, int]:
    """Default tritonserver ports of ``serve all|scheduler`` whose HTTP front is on ``front``
    (module docstring): the three after the last of ``front`` and the context and
    generation urls' ports; ``DEFAULT_PORTS`` for ``serve all`` without a scheduler url."""
    if role == Role.ALL and config.scheduler.url is None:
        return dict(DEFAULT_PORTS)
    last = max([front, *(int(url.rsplit(":", 1)[1]) for peer in ("context", "generation")
                         for url in config.server(peer).urls)])
    if last + len(TRITON_KINDS) > MAX_PORT:
        raise UserError(f"tritonserver's ports follow port {last}, past {MAX_PORT}; give "
                        f"--http-port, --grpc-port and --metrics-port")
    return {kind: last + 1 + i for i, kind in enumerate(TRITON_KINDS)}


def endpoints_for(role: str, config: DisaggConfig, flags: PortFlags) -> Endpoints:
    front = role in (Role.ALL, Role.SCHEDULER)
    server = config.scheduler if front else config.server(role)
    host = flags.host or (_bind_host(server.host, role) if role != Role.ALL and server.url
                          else "127.0.0.1")
    if front:
        given = {"grpc": flags.grpc or server.grpc_port, "http": flags.http or server.http_port,
                 "metrics": flags.metrics or server.metrics_port}
        if None in given.values():      # the defaults follow the deployment's ports
            defaults = triton_ports(role, config, front_port(role, config, flags.front))
            given = {kind: port or defaults[kind] for kind, port in given.items()}
        grpc, http, metrics = given["grpc"], given["http"], given["metrics"]
    else:
        grpc = flags.grpc or server.port or DEFAULT_PORTS["grpc"]
        http = flags.http or server.http_port
        metrics = flags.metrics or server.metrics_port
    used = [p for p in (http, grpc, metrics) if p is not None]
    if len(set(used)) != len(used):
        raise UserError(f"ports collide (http {http}, grpc {grpc}, metrics {metrics}); "
                        f"pick distinct --http-port/--grpc-port/--metrics-port")
    return Endpoints(host=host, http_port=http, grpc_port=grpc, metrics_port=metrics)


def behind_door(endpoints: Endpoints, promised: tuple[int, ...] = ()) -> Endpoints:
    """``endpoints`` with tritonserver's gRPC, HTTP and metrics moved to loopback ports
    picked free, behind the doors (module docstring): never one of the public ports, which
    the doors bind only after tritonserver starts, nor one ``promised`` to this server (the
    HTTP front's, its KV event publishers')."""
    public = (endpoints.grpc_port, endpoints.http_port, endpoints.metrics_port, *promised)
    grpc, http, metrics = free_ports(3, avoid=frozenset(p for p in public if p is not None))
    return replace(endpoints, inner_grpc_port=grpc,
                   inner_http_port=None if endpoints.http_port is None else http,
                   inner_metrics_port=None if endpoints.metrics_port is None else metrics)


def advertised_url(role: str, config: DisaggConfig, endpoints: Endpoints,
                   flags: PortFlags) -> str | None:
    """``host:port`` a context or generation server tells its peers (module docstring);
    None for the roles that advertise nothing (all, scheduler)."""
    if role not in ENGINE_ROLES:
        return None
    if flags.advertise:
        return flags.advertise
    host = endpoints.host
    if host in WILDCARDS:
        host = config.server(role).host
        if host is None:
            raise UserError(f"--host {endpoints.host} binds every address; name the one peers "
                            f"reach with --advertise HOST:PORT")
    return f"{host}:{endpoints.grpc_port}"


def token_host(role: str, config: DisaggConfig, advertised: str | None) -> str | None:
    """Where ``role``'s ZeroMQ sockets bind and what they advertise (None: ipc; module
    docstring). ``advertised``: the generation server's :func:`advertised_url`."""
    if role == Role.GENERATION:
        return advertised.rsplit(":", 1)[0]
    if role != Role.SCHEDULER:
        return None
    if config.generation.urls:
        key = "generation_server.url" + ("s" if len(config.generation.urls) > 1 else "")
        peers = config.generation.urls
    else:
        key, peers = "discovery.etcd", (config.discovery.etcd,)
    routes = {url: _route_from(url, key) for url in peers}
    if len(set(routes.values())) > 1:
        seen = ", ".join(f"{url} from {address}" for url, address in routes.items())
        raise UserError(f"{key}: this host reaches {seen}, but the scheduler's token socket has "
                        f"one address; put the generation servers on one network")
    return next(iter(routes.values()))


def _route_from(url: str, key: str) -> str:
    """This host's address on the route to ``url`` (host:port)."""
    host, port = url.rsplit(":", 1)
    ip = _resolve(host, key)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((ip, int(port)))   # a UDP connect sends nothing
        except OSError as exc:
            raise UserError(f"{key}: no route from this host to {host} ({exc.strerror})") from None
        return sock.getsockname()[0]


def check_ports_free(endpoints: Endpoints) -> None:
    """Refuse ports something else listens on (its health endpoint would answer for us)."""
    for kind, port in (("http", endpoints.http_port), ("grpc", endpoints.grpc_port),
                       ("metrics", endpoints.metrics_port)):
        if port is None:
            continue
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((endpoints.host, port))
            except OSError as exc:
                raise UserError(f"{kind} port {port} on {endpoints.host} is not free ({exc.strerror});"
                                f" stop what uses it or pass --{kind}-port") from None


def free_ports(n: int, host: str = "127.0.0.1", avoid: frozenset[int] = frozenset()
               ) -> list[int]:
    """``n`` distinct ports free on ``host`` right now, below the kernel's ephemeral range
    (:func:`free_port_run`; for tests and benches that start servers: a port can still be
    taken before the server binds it, but not by a socket the kernel numbers itself), none
    in ``avoid`` (ports free now that are promised to something else)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port_run(1, host)
        if port not in ports and port not in avoid:
            ports.append(port)
    return ports


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive ports free on ``host`` now (a deployment's ports
    moved in their pattern, or a pool's ``kv_events_port`` run), picked at random below the
    kernel's ephemeral range: the ports it gives sockets bound to port 0 and outgoing
    connections (UCX's listeners in the stubs of a server starting beside this one took a
    port picked there before its tritonserver bound it)."""
    import random

    first, stop = LOWEST_PICKED_PORT, max(_ephemeral_start(), LOWEST_PICKED_PORT + 1024)
    for _ in range(200):
        base = random.randrange(first, stop - count)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
            return base
    raise UserError(f"no {count} consecutive free ports on {host}")


def _ephemeral_start(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range (Linux's default when unknown)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bind_host(host: str, role: str) -> str:
    if is_loopback(host):
        return "127.0.0.1"
    return _resolve(host, f"{role}_server.url", " or pass --host 0.0.0.0")


def _resolve(host: str, key: str, hint: str = "") -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        raise UserError(f"{key}: host {host!r} does not resolve on this machine; "
                        f"fix the url{hint}") from None


def ucx_env(role: str, host: str, gpus: bool = False) -> dict[str, str]:
    """UCX (under NIXL, in the stubs) listens on every network interface by default, and
    below NIXL its software RMA checks no remote key. ``serve all``, whose NIXL peers are
    all stubs of its one tritonserver, uses shared memory alone (``UCX_TLS=self,sm``, with
    ``gpus`` placed also ``cuda_copy,cuda_ipc`` for KV in GPU memory: no
    socket at all, where a TCP listener on 127.0.0.1 would take any local user; the agents
    then make endpoints without a peer failure handler, which shared memory lacks:
    :func:`triton_disagg.kv.nixl_agent.error_handling_mode`). A server bound to loopback
    listens on loopback alone (``UCX_NET_DEVICES=lo``), so nothing of it is reachable from
    another host. A ``UCX_TLS`` or ``UCX_NET_DEVICES`` in serve's environment wins."""
    env = {}
    if role == Role.ALL and "UCX_TLS" not in os.environ:
        env["UCX_TLS"] = "self,sm,cuda_copy,cuda_ipc" if gpus else "self,sm"
    if is_loopback(host) and "UCX_NET_DEVICES" not in os.environ:
        env["UCX_NET_DEVICES"] = "lo"
    return env


def start(role: str, config: DisaggConfig, endpoints: Endpoints, work_dir: Path,
          tritonserver: str | None = None, log_verbose: int = 0,
          token: str | None = None, kv_events_host: str | None = None,
          kv_events_port: int | None = None) -> TritonServer:
    """Render ``role``'s repository under ``work_dir`` (ZeroMQ on ``token``, see
    :func:`token_host`; KV events advertised on ``kv_events_host``, bound on the server's
    host, from ``kv_events_port`` on) and start its server (not yet ready), on the front end's cores
    (:func:`~triton_disagg.config.host.front_cpus`). Refused, before anything is rendered
    or started, where tritonserver would get the shared ``/dev/shm`` without the user's
    opt-in (:func:`~triton_disagg.triton.private_shm.refuse_shared`), or where another
    local user could change ``work_dir`` (:func:`.work_dir.refuse_replaceable`)."""
    private_shm.refuse_shared()
    work_dir.mkdir(parents=True, exist_ok=True)
    refuse_replaceable(work_dir)
    check_ports_free(endpoints)
    install = locate(tritonserver)
    check_stub(install.stub_binary, server_env(install))
    work_dir = work_dir.resolve()
    bind = endpoints.host if role == Role.GENERATION or kv_events_host else None
    repo = render(role, config, work_dir / "model_repository", token, bind, kv_events_host,
                  kv_events_port)
    gpus = bool(config.context.gpus or config.generation.gpus)
    server = TritonServer(install, repo, endpoints, work_dir,
                          env=ucx_env(role, endpoints.host, gpus), log_verbose=log_verbose,
                          cpus=front_cpus(config, role, os.sched_getaffinity(0)),
                          grpc_tls=config.grpc_tls)
    server.start()
    return server

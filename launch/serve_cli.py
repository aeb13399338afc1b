"""``triton-disagg serve all|context|generation|scheduler``.

Renders the role's model repository into its work directory (:mod:`.work_dir`: one per
server, ``--work-dir`` or ``work/<role>-<address>-<gRPC port>``), starts tritonserver,
waits until it is ready, prints the endpoints (:mod:`.serve_banner`; for a role with the
ensemble, a curl line), then runs until Ctrl-C / SIGTERM or until the server
dies, and stops the server's whole process group on the way out. With ``discovery`` in
the config, a context or generation server registers in etcd once ready and deregisters
before it stops (:mod:`.register`). A model's stub
process that dies (Triton 2.51 neither restarts it nor turns not-ready) stops the
server at once, so its clients get errors and probes fail, and starts it afresh
(:mod:`.stub_watch`); so does a start that failed for a cause the next start need not
meet, such as a stub Triton abandoned while the host was busy (:mod:`.stuck_start`). The
scheduler says "up" once its models are loaded, then "ready" or "not ready" as the servers
of the roles it routes to come and go, as its ``/healthz`` does (:mod:`.roles_gate`).
Every role's server has an HTTP front beside it (:mod:`.front_process`), so every role
answers ``GET /healthz``.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path
from typing import Sequence

from triton_disagg.config.roles import ENGINE_ROLES, PLACED_ROLES, SERVE_ROLES, Role
from triton_disagg.errors import RetryableStart, UserError
from triton_disagg.log_format import FORMATS

from triton_disagg.triton import private_shm
from triton_disagg.triton.stub_watch import Stub, first_dead, model_instance_stubs

from .restarts import MAX_RESTARTS, RESTART_WINDOW_SECONDS, RestartBudget, keep_log, kept_log

STUB_POLL_SECONDS = 0.5


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model repository with tritonserver",
        description="Render a role's Triton model repository and run tritonserver on it. "
                    "`all` runs every model in one server (context and generation reached "
                    "in-process); the other roles run one part, the scheduler routing each "
                    "request over the context and generation servers of the config's urls "
                    "or of etcd (discovery), over gRPC.")
    p.add_argument("role", choices=SERVE_ROLES)
    p.add_argument("-c", "--config", type=Path, help="disagg_config.yaml")
    p.add_argument("--engine", type=Path, help="engine directory (replaces model.engine)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model id clients send to the OpenAI front and /v1/inference "
                        "(replaces model.name; default the engine directory's name)")
    p.add_argument("--gpus", metavar="0,1",
                   help="context/generation: the GPUs of the role's instances, one instance "
                        "per GPU (replaces the role's gpus:, cpus: and instances:)")
    p.add_argument("--host", help="bind address (default 127.0.0.1, or the host of the role's url)")
    p.add_argument("--advertise", metavar="HOST:PORT",
                   help="context/generation: the gRPC address peers are told, and registered "
                        "in etcd with discovery (default: the bind address and gRPC port); "
                        "generation's token sockets bind its host")
    p.add_argument("--http-port", type=int,
                   help="tritonserver's HTTP port. scheduler: scheduler_server.http_port, else "
                        "the first of the three ports after the deployment's last (its front's "
                        "and the roles' urls'; README, Ports); all: 8000 (or as the scheduler "
                        "with scheduler_server.url); context/generation: the role's http_port, "
                        "else HTTP off")
    p.add_argument("--grpc-port", type=int,
                   help="tritonserver's gRPC port. scheduler: scheduler_server.grpc_port, else "
                        "the second of those three; all: 8001 (or as the scheduler); "
                        "context/generation: the port of the role's url, else 8001")
    p.add_argument("--metrics-port", type=int,
                   help="tritonserver's metrics port. scheduler: "
                        "scheduler_server.metrics_port, else the third of those three; all: "
                        "8002 (or as the scheduler); context/generation: the role's "
                        "metrics_port, else metrics off")
    p.add_argument("--front-port", type=int,
                   help="the HTTP front's port: all/scheduler: OpenAI API, /v1/inference, "
                        "/healthz (default scheduler_server.front_port, else the port of "
                        "scheduler_server.url, else 8080 for all and 8002 for the scheduler); "
                        "context/generation: /healthz (default the role's front_port, else "
                        "8081 / 8082)")
    p.add_argument("--tritonserver", help="tritonserver binary (default: the one in nvidia-pytriton)")
    p.add_argument("--work-dir", type=Path,
                   help="where the repository and logs go, one serve at a time (default "
                        "work/<role>-<address>-<gRPC port>)")
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    p.add_argument("--log-format", choices=FORMATS, default="text",
                   help="json: serve's lines and every stub's are JSON objects (time, level, "
                        "role, instance, request_id, message), one per line, with a line per "
                        "request; tritonserver's own lines get ISO8601 time")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for ready")
    p.add_argument("--no-restart", action="store_true",
                   help="exit 1 when a model's stub process dies, instead of restarting "
                        "tritonserver (for a supervisor that restarts serve)")
    p.add_argument("--overlap_kv_transfer", action="store_true",
                   help="generation reads each prompt's KV layer by layer while the context "
                        "still prefills it (kv_cache.overlap_transfer: true; direct_transfer "
                        "only); it changes the flow of serve all|scheduler")
    p.set_defaults(func=run)


def load(args: argparse.Namespace):
    from dataclasses import replace

    from triton_disagg.config.disagg import (check_model_name, default_config, load_config,
                                             with_overlap)
    from triton_disagg.config.host import check_host, with_gpus_flag
    from triton_disagg.config.values import parse_url
    from triton_disagg.engine.capacity import check_kv_capacity

    if args.config is None:
        if args.engine is None:
            raise UserError("give -c disagg_config.yaml or --engine DIR")
        if args.role == Role.SCHEDULER:
            raise UserError("serve scheduler needs -c disagg_config.yaml naming the context and "
                            "generation servers (urls, or discovery through etcd)")
        config = default_config(args.engine)
    else:
        config = load_config(args.config, engine=args.engine)
    if args.served_model_name is not None:
        config = replace(config, model_name=check_model_name(args.served_model_name,
                                                             "--served-model-name"))
    if args.gpus is not None:
        config = with_gpus_flag(config, args.role, args.gpus)
    if args.overlap_kv_transfer:
        config = with_overlap(config)
    if args.role == Role.SCHEDULER and config.discovery is None:
        for role in config.engine_roles:
            if not config.server(role).urls:
                raise UserError(f"{config.source}: {role}_server.url: missing; the scheduler "
                                f"routes over the role's servers: give `{role}_server: {{url: "
                                f"\"HOST:PORT\"}}` or `urls: [...]`, or `discovery: {{etcd: "
                                f"\"HOST:2379\"}}`")
    if args.advertise is not None:
        if args.role not in ENGINE_ROLES:
            raise UserError(f"--advertise: serve {args.role} advertises nothing; it is for "
                            f"serve context|generation")
        args.advertise = parse_url(args.advertise, "--advertise")
    check_host(config, roles=_placed_here(args.role))
    if args.role != Role.SCHEDULER:
        check_kv_capacity(config, None if args.role == Role.ALL else (args.role,))
    return config


def _placed_here(role: str) -> tuple[str, ...]:
    """The roles whose placement ``serve role`` checks against this host: the scheduler's
    front end runs where ``serve all`` or ``serve scheduler`` runs; ``serve context`` and
    ``serve generation`` check both of those roles, as they always have."""
    placed: dict[str, tuple[Role, ...]] = {Role.ALL: PLACED_ROLES,
                                           Role.SCHEDULER: (Role.SCHEDULER,)}
    return placed.get(role, ENGINE_ROLES)


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C / SIGTERM. A stub process that dies restarts the whole server
    (Triton 2.51 does not restart it and keeps reporting ready), and so does a tritonserver
    killed by a signal (a stub dying mid-exchange can abort it), up to ``MAX_RESTARTS``
    times within ``RESTART_WINDOW_SECONDS`` (:class:`RestartBudget`); with ``--no-restart``
    serve exits 1 instead, for a supervisor to restart."""
    from .deploy import PortFlags, advertised_url, endpoints_for, token_host
    from .front_process import front_port
    from .work_dir import claim, default

    config = load(args)
    os.umask(0o077)     # what serve, tritonserver and the front write is this user's alone:
    # logs carry request ids, errors and internal addresses; the work dir holds the repository
    private_shm.refuse_shared()
    _log_format(args.log_format, args.role)
    flags = PortFlags(args.host, args.http_port, args.grpc_port, args.metrics_port,
                      args.advertise, args.front_port)
    endpoints = endpoints_for(args.role, config, flags)
    advertised = advertised_url(args.role, config, endpoints, flags)
    token = token_host(args.role, config, advertised)
    front = front_port(args.role, config, args.front_port)
    args.work_dir = args.work_dir or default(args.role, endpoints.host, endpoints.grpc_port)
    lock = claim(args.work_dir)     # held until serve exits
    stop, hurry = threading.Event(), threading.Event()    # the first signal, a second one
    previous = {s: signal.signal(s, lambda *_: (hurry if stop.is_set() else stop).set())
                for s in (signal.SIGINT, signal.SIGTERM)}
    budget, restart = RestartBudget(), 0
    try:
        while True:
            outcome = _serve_once(args, config, endpoints, advertised, token, front, stop,
                                  hurry, restart)
            if isinstance(outcome, int):
                return outcome
            print(f"triton-disagg serve {args.role}: {outcome}", flush=True)
            if args.no_restart:
                return 1
            if not budget.spend():
                print(f"triton-disagg serve {args.role}: {MAX_RESTARTS} restarts within "
                      f"{RESTART_WINDOW_SECONDS / 60:g} min; giving up", flush=True)
                return 1
            restart += 1
            print(f"triton-disagg serve {args.role}: restarting tritonserver "
                  f"({len(budget.spent)} of at most {MAX_RESTARTS} in "
                  f"{RESTART_WINDOW_SECONDS / 60:g} min); the stopped server's log is "
                  f"{kept_log(args.work_dir, restart)}", flush=True)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        lock.close()


def _log_format(chosen: str, role: str) -> None:
    """``--log-format json``: serve's stdout becomes JSON lines, and tritonserver and its
    stubs (which inherit this environment) are told so (:mod:`triton_disagg.log_format`)."""
    import sys

    from triton_disagg.log_format import FORMAT_ENV, ROLE_ENV, JsonLines

    if chosen == "json":
        os.environ.update({FORMAT_ENV: "json", ROLE_ENV: role})
        sys.stdout = JsonLines(sys.stdout, role)


def _serve_once(args, config, endpoints, advertised: str | None, token: str | None,
                front: int, stop: threading.Event, hurry: threading.Event,
                restart: int) -> int | str:
    """Start tritonserver and the HTTP front on port ``front`` (:mod:`.front_process`),
    announce it ready (registering ``advertised`` in etcd when the config has discovery),
    watch it: returns serve's exit code, or why it must restart (a
    stub died, tritonserver was killed by a signal, or a port picked behind the door was
    taken before tritonserver bound it; it is stopped and deregistered by then). A context
    or generation server stopped by a signal deregisters, then drains (:mod:`.drain`; a
    second signal cuts that short)."""
    from .deploy import behind_door, start
    from .drain import drain
    from .front_process import check_front_port, health_only, start_front, stop_front, wait_door
    from .roles_gate import check_before_start, gate_file, start_roles_gate
    from .register import served_models, start_registration
    from .serve_banner import announce

    work_dir = args.work_dir
    if restart:
        keep_log(work_dir, restart)
    check_front_port(endpoints.host, front, endpoints)
    kv_events_host, kv_events_ports = _kv_events_at(args.role, config, advertised)
    endpoints = behind_door(endpoints, (front, *kv_events_ports))   # picked afresh each start
    gated = args.role == Role.SCHEDULER
    if gated:
        work_dir.mkdir(parents=True, exist_ok=True)
    reason = check_before_start(config, work_dir.resolve(), args.role) if gated else None
    server = start(args.role, config, endpoints, work_dir, args.tritonserver, args.log_verbose,
                   token, kv_events_host, kv_events_ports[0] if kv_events_ports else None)
    if not server.private_shm and not restart:
        print(f"triton-disagg serve {args.role}: note: this host allows no private /dev/shm "
              f"(a mount namespace) and {private_shm.ALLOW_SHARED_ENV}=1 serves on the shared "
              f"one: local users can read tritonserver's Python-backend regions, prompts and "
              f"outputs included (docs/architecture.md, trust boundaries)", flush=True)
    models = sorted(p.name for p in server.repo.iterdir() if p.is_dir())
    front_proc = start_front(config, endpoints, front, server.grpc_url, server.work_dir,
                             tuple(models), health_only(args.role, config),
                             gate_file(server.work_dir) if gated else None,
                             peers=args.role in ENGINE_ROLES)
    print(f"triton-disagg serve {args.role}: tritonserver started, loading {len(models)} models "
          f"({', '.join(models)}); log {server.log_path}", flush=True)
    if args.role in (Role.ALL, Role.SCHEDULER):
        cores = f"cores {list(server.cpus)}" if server.cpus else "every usable core (not pinned)"
        print(f"  front end (tritonserver, preprocessing, orchestrator) on {cores}", flush=True)
    loaded: list[str] = []
    registration = roles_gate = None
    seen: dict[int, Stub] = {}      # every model instance's stub seen since the start, by pid

    def see_stubs() -> None:
        """Remember the stubs running now."""
        seen.update((s.pid, s) for s in model_instance_stubs(server.process.pid))

    def on_loaded(model: str) -> None:
        see_stubs()              # its stubs run from here on, before the server is ready
        loaded.append(model)
        print(f"  loaded {model} ({len(loaded)}/{len(models)})", flush=True)

    try:
        try:
            if not server.wait_ready(args.ready_timeout, cancel=stop, on_loaded=on_loaded):
                return 130
        except RetryableStart as exc:     # a start that may succeed if tried again
            server.stop(grace=0)
            return f"tritonserver did not start: {exc}"
        wait_door(front_proc, server.local_host, endpoints, args.ready_timeout)
        # A stub killed between the server's readiness and this listing is no longer listed
        # (a zombie has no argv): those seen as their models loaded are watched too.
        see_stubs()
        stubs = list(seen.values())
        served = served_models(args.role, config, server)
        if config.discovery is not None and advertised is not None:
            registration = start_registration(args.role, config, endpoints, advertised,
                                              served)
        announce(args.role, config, endpoints, advertised, server, registration, front,
                  tuple(a for m in served for a in m.kv_events))
        if gated:
            roles_gate = start_roles_gate(config, server.work_dir, reason, args.role)
        while not stop.wait(STUB_POLL_SECONDS):
            dead = first_dead(stubs)
            if dead is not None:   # no graceful exit: it would hold streams for the exit timeout
                server.stop(grace=0)
                return (f"the stub process of {dead.instance} (pid {dead.pid}) died; Triton "
                        f"cannot restart it, so tritonserver was stopped and its clients got "
                        f"errors")
            if front_proc.poll() is not None:
                server.stop(grace=0)
                return (f"the HTTP front (pid {front_proc.pid}) exited with code "
                        f"{front_proc.returncode}; see {server.work_dir / 'http_front.log'}")
            code = server.process.poll()
            if code is not None:
                print(f"tritonserver exited with code {code}:\n{server.log_tail()}", flush=True)
                return f"tritonserver was killed by signal {-code}" if code < 0 else 1
        if args.role in ENGINE_ROLES:
            if registration is not None:
                registration.close()
                registration = None
            drain(endpoints.server_metrics_url, args.role, hurry,
                  lambda line: print(f"triton-disagg serve {args.role}: {line}", flush=True))
        print("stopping tritonserver ...", flush=True)
        return 0
    finally:
        stop_front(front_proc)
        if roles_gate is not None:
            roles_gate.stop()
        if registration is not None:
            registration.close()
        server.stop()


def _kv_events_at(role: str, config, advertised: str | None
                  ) -> tuple[str | None, Sequence[int]]:
    """Where a context or generation server's KV event publishers bind: tcp on its advertised
    host, on its ports (:func:`~triton_disagg.routing.kv_events.publisher_ports`; none: free
    ports); (None, ()) for the other roles (ipc)."""
    from triton_disagg.routing.kv_events import publisher_ports

    if advertised is None or role not in ENGINE_ROLES:
        return None, ()
    server = config.server(role)
    ports = () if server.kv_events_port is None else publisher_ports(
        server.kv_events_port, server.urls, advertised, server.instances)
    return advertised.rsplit(":", 1)[0], ports

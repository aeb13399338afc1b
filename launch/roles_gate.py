"""``serve scheduler``: its ``/healthz`` follows the roles it routes to.

A scheduler can serve only while each role it routes to (context and generation;
generation alone in aggregated mode) has a server that answers. Every ``CHECK_SECONDS``
:class:`RolesGate` asks each role's servers (the config's urls, or the servers registered
in etcd) for gRPC ``ServerReady``, and for ``ModelReady`` of each model the scheduler
calls there when it calls more than the role's own (a context server's instance models:
a static pool placing more context instances than a server runs would call models it
lacks), in url order until one says yes, and writes the
answer into the gate file (:func:`gate_file`, in serve's work directory): empty when
every role has a server that answers, else one line naming the first role that has none.
The scheduler's HTTP front reads it at each ``GET /healthz``
(:class:`~triton_disagg.front.health.ServerReadiness`, told where by ``GATE_ENV``): 200
only while the file is empty and tritonserver and its models are ready.

The gate starts as one check before tritonserver starts (:func:`check_before_start`), so
the scheduler is never ready before a check (no file: not ready).

Triton's own ``/v2/health/ready`` says whether the scheduler's models are loaded, not
whether those roles answer: following them there would take loading and unloading a model,
that is Triton's model-control API, which lets whoever may call it load a model (code);
it is off (:mod:`triton_disagg.triton.tritonserver`).

Invariants: the file is replaced whole (a reader sees the old or the new line, never
part); serve prints one line per change of state or reason; after :meth:`RolesGate.stop`
no check runs and no client is left open.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from triton_disagg.config.roles import Role
from triton_disagg.config.tls_section import GrpcTLS
from triton_disagg.routing.discovery.periodic import Periodic
from triton_disagg.triton.grpc_channel import client_options

if TYPE_CHECKING:
    from triton_disagg.config.disagg import DisaggConfig

CHECK_SECONDS = 1.0
PROBE_TIMEOUT = 1.0         # seconds a member may take to answer ServerReady


def gate_file(work_dir: Path) -> Path:
    return work_dir / "roles_gate"


def write_gate(path: Path, reason: str | None) -> None:
    """The gate file says ``reason`` (None: every role answers), replaced whole."""
    part = path.with_name(path.name + ".new")
    part.write_text(reason or "")
    os.replace(part, path)


class RoleServers:
    """Which role has no server that answers; ``sources`` per role (:mod:`serving.pools`),
    probed over TLS when ``tls`` (the config's ``grpc_tls``) is given."""

    def __init__(self, sources: dict, membership=None, tls: GrpcTLS | None = None):
        self.sources, self.membership, self.tls = sources, membership, tls
        self._clients: dict[str, object] = {}

    def start(self) -> "RoleServers":
        """Start following etcd, when the members come from there."""
        if self.membership is not None:
            self.membership.start()
        return self

    def missing(self) -> str | None:
        """One line naming the first role without a server that answers, else None."""
        servers: dict[str, dict[str, list[str]]] = {}    # role -> url -> models called there
        for role, source in self.sources.items():
            servers[role] = {}
            for m in source.members():
                servers[role].setdefault(m.url, []).extend([m.model] if m.model else [])
        current = {url for role_urls in servers.values() for url in role_urls}
        for url in set(self._clients) - current:          # members that left
            self._clients.pop(url).close()
        for role, source in self.sources.items():
            said = []
            for url, models in servers[role].items():
                lacking = self._lacking(url, models)
                if lacking is None:
                    break
                said.append(f"{url} without model {', '.join(lacking)}" if lacking else url)
            else:
                who = f" answers ({', '.join(said)})" if said else ""
                return f"no {role} server {source.where()}{who}"
        return None

    def _lacking(self, url: str, models: list[str]) -> list[str] | None:
        """None when the server at ``url`` is ready with each of ``models``, else those it
        lacks ready ([]: the server itself is not ready or does not answer)."""
        import tritonclient.grpc as grpcclient

        if url not in self._clients:
            self._clients[url] = grpcclient.InferenceServerClient(url,
                                                                  **client_options(self.tls))
        client = self._clients[url]
        if not _asked(lambda: client.is_server_ready(client_timeout=PROBE_TIMEOUT)):
            return []
        lacking = [m for m in models
                   if not _asked(lambda: client.is_model_ready(m, client_timeout=PROBE_TIMEOUT))]
        return lacking or None

    def close(self) -> None:
        if self.membership is not None:
            self.membership.close()
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def _asked(ready: Callable[[], bool]) -> bool:
    """What a readiness probe says; False when it fails (refused, unreachable, timed out,
    an unknown model)."""
    try:
        return bool(ready())
    except Exception:  # noqa: BLE001 - any failure: not ready
        return False


class RolesGate:
    """Checks ``servers`` every ``CHECK_SECONDS`` on a thread of its own and writes the answer
    into the gate file ``path``, whose state ``reason`` is (None: open); ``say`` prints a
    line."""

    def __init__(self, servers: RoleServers, path: Path, reason: str | None, say):
        self.servers, self.path, self.say = servers, path, say
        self._reason: str | None = reason
        self._said = False
        self._checks = Periodic(self._check, CHECK_SECONDS, "roles-gate")

    def start(self) -> "RolesGate":
        """Check now, then every ``CHECK_SECONDS``."""
        self.servers.start()
        self._checks.start()
        return self

    def stop(self) -> None:
        self._checks.stop()
        self.servers.close()

    def _check(self) -> None:
        """Write the gate when its reason changes, and say so (and say the first)."""
        reason = self.servers.missing()
        if reason != self._reason:
            try:
                write_gate(self.path, reason)
            except OSError as exc:
                self.say(f"could not write the readiness gate {self.path} ({exc}); trying again")
                return
        if not self._said or reason != self._reason:
            self.say("ready (every role has a server that answers)" if reason is None
                     else f"not ready: {reason}")
        self._said, self._reason = True, reason


def start_roles_gate(config, work_dir: Path, reason: str | None, role: str) -> RolesGate:
    """The gate of ``serve role`` in ``work_dir``, checking the roles the scheduler routes to
    (generation alone in aggregated mode), from the state ``reason`` that
    :func:`check_before_start` wrote; it prints as ``serve`` does."""
    say = lambda line: print(f"triton-disagg serve {role}: {line}", flush=True)  # noqa: E731
    return RolesGate(_role_servers(config, role), gate_file(work_dir), reason, say).start()


def check_before_start(config, work_dir: Path, role: str) -> str | None:
    """One check of the roles' servers, written into the gate file before tritonserver and the front
    start; returns its reason (None: every role answers)."""
    servers = _role_servers(config, role).start()
    try:
        reason = servers.missing()
    finally:
        servers.close()
    write_gate(gate_file(work_dir), reason)
    return reason


def _role_servers(config: "DisaggConfig", role: str) -> RoleServers:
    """The members of the roles the scheduler routes to (generation alone when aggregated)."""
    from triton_disagg.routing.pools import member_sources

    from triton_disagg.triton.render import settings

    membership, sources = member_sources(settings("orchestrator", role, config))
    if config.aggregated:
        del sources[Role.CONTEXT]
    return RoleServers(sources, membership, config.grpc_tls)

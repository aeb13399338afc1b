"""``serve scheduler``: Triton's ``/v2/health/ready`` follows the scheduler's peers.

A scheduler can serve only while each role it routes to (context and generation;
generation alone in aggregated mode) has a server that answers. ``/v2/health/ready`` is
tritonserver's own endpoint, and Triton 2.51 (``--strict-readiness``, the default) reports
not ready while any model of the repository is neither READY nor unloaded. The
scheduler's repository therefore holds a gate model, ``peers_ready`` (``model_repo/``),
whose load fails with the reason in its config, or succeeds when the reason is empty.
Every ``CHECK_SECONDS`` :class:`PeersGate` asks each role's members (the config's urls, or
the servers registered in etcd) for gRPC ``ServerReady``, in url order until one says yes,
and

- opens the gate (loads it) once every role has a server that answers,
- closes it when a role has none: unloads it, then loads it with the reason, which fails
  (a READY model whose reload fails would stay READY); the server reports not ready from
  the unload on (UNLOADING, LOADING, then failed).

The gate starts as one check before tritonserver starts finds the peers
(:func:`check_before_start`): open when they answer, so a healthy start logs no ERROR;
else closed, and tritonserver (``--exit-on-error=false``) fails its load with the reason.
The scheduler is never ready before a check.

Loading models takes ``--model-control-mode=explicit``, whose repository API would let any
client load a model (``model_repo/`` files included: code). So that API is restricted
(``--http-restricted-api`` / ``--grpc-restricted-protocol`` on ``model-repository``, with
the APIs every server restricts: :mod:`triton_disagg.triton.tritonserver`) to a header
whose value is a secret made at each start, which only serve sends: to clients the
model-control API stays off, as the design asks. (The secret is on tritonserver's command
line, which the host's local users can read.)

Invariants: the gate is loaded only when its state changes (the first check starts from
the state :func:`check_before_start` left); its stub, which comes and goes with it, is
not among those serve watches; serve prints one line per change of
state or reason; after :meth:`PeersGate.stop` no check runs and no client is left open.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from triton_disagg.routing.discovery.periodic import Periodic

from triton_disagg.triton.grpc_channel import channel_args
from triton_disagg.triton.render import GATE, render_gate
from triton_disagg.triton.tritonserver import RESTRICTED_HEADER

CHECK_SECONDS = 1.0
PROBE_TIMEOUT = 1.0         # seconds a member may take to answer ServerReady


@dataclass(frozen=True)
class GateControl:
    """What tritonserver needs to run with the gate: explicit model control, its API
    (``restricted_apis``) restricted to ``secret``."""

    models: tuple[str, ...]                 # every model of the repository, the gate included
    gate: str = GATE
    secret: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    restricted_apis: tuple[str, ...] = ("model-repository",)

    def server_args(self) -> list[str]:
        return ["--model-control-mode=explicit", "--exit-on-error=false",
                *(f"--load-model={m}" for m in self.models)]

    @property
    def grpc_headers(self) -> dict[str, str]:
        return {f"triton-grpc-protocol-{RESTRICTED_HEADER}": self.secret}


class Peers:
    """Which role has no server that answers; ``sources`` per role (:mod:`serving.pools`)."""

    def __init__(self, sources: dict, membership=None):
        self.sources, self.membership = sources, membership
        self._clients: dict[str, object] = {}

    def start(self) -> "Peers":
        """Start following etcd, when the members come from there."""
        if self.membership is not None:
            self.membership.start()
        return self

    def missing(self) -> str | None:
        """One line naming the first role without a server that answers, else None."""
        urls = {role: [m.url for m in source.members()] for role, source in self.sources.items()}
        current = {url for role_urls in urls.values() for url in role_urls}
        for url in set(self._clients) - current:          # members that left
            self._clients.pop(url).close()
        for role, source in self.sources.items():
            if not any(self._answers(url) for url in urls[role]):
                who = f" answers ({', '.join(urls[role])})" if urls[role] else ""
                return f"no {role} server {source.where()}{who}"
        return None

    def _answers(self, url: str) -> bool:
        import tritonclient.grpc as grpcclient

        if url not in self._clients:
            self._clients[url] = grpcclient.InferenceServerClient(url, channel_args=channel_args())
        try:
            return bool(self._clients[url].is_server_ready(client_timeout=PROBE_TIMEOUT))
        except Exception:  # noqa: BLE001 - refused, unreachable, timed out: it does not answer
            return False

    def close(self) -> None:
        if self.membership is not None:
            self.membership.close()
        for client in self._clients.values():
            client.close()
        self._clients.clear()


class PeersGate:
    """Checks ``peers`` every ``CHECK_SECONDS`` on a thread of its own and sets the gate of the
    server at ``grpc_url`` (repository ``repo``, run with ``control``); ``say`` prints a line."""

    def __init__(self, peers: Peers, repo: Path, grpc_url: str, control: GateControl, say):
        import tritonclient.grpc as grpcclient

        self.peers, self.repo, self.control, self.say = peers, repo, control, say
        self._client = grpcclient.InferenceServerClient(grpc_url)
        self._open: bool | None = None          # None: not checked yet (the first check asks Triton)
        self._reason: str | None = None
        self._checks = Periodic(self._check, CHECK_SECONDS, "peers-gate")

    def start(self) -> "PeersGate":
        """Check now, then every ``CHECK_SECONDS``."""
        self.peers.start()
        self._checks.start()
        return self

    def stop(self) -> None:
        self._checks.stop()
        self.peers.close()
        self._client.close()

    def _check(self) -> None:
        """Set the gate when its state must change, then say so (or say a new reason)."""
        from tritonclient.utils import InferenceServerException

        reason = self.peers.missing()
        first = self._open is None
        if first:           # as check_before_start left it: open, or closed
            self._open = self._gate_ready()
        changed = self._open != (reason is None)
        if changed:
            try:
                self._set(reason)
            except InferenceServerException as exc:
                self.say(f"could not set the readiness gate ({exc.message()}); trying again")
                return
            self._open = reason is None
        if first or changed or reason != self._reason:
            self.say("ready (every role has a server that answers)" if reason is None
                     else f"not ready: {reason}")
        self._reason = reason

    def _gate_ready(self) -> bool:
        try:
            return bool(self._client.is_model_ready(GATE, client_timeout=PROBE_TIMEOUT))
        except Exception:  # noqa: BLE001 - no answer: treat it as closed, so it gets set
            return False

    def _set(self, reason: str | None) -> None:
        from tritonclient.utils import InferenceServerException

        headers = self.control.grpc_headers
        if reason is None:
            render_gate(self.repo, "")
            self._client.load_model(GATE, headers=headers)
            return
        self._client.unload_model(GATE, headers=headers)
        render_gate(self.repo, reason)
        try:
            self._client.load_model(GATE, headers=headers)
        except InferenceServerException as exc:
            if "not ready:" not in (exc.message() or ""):   # else it failed as it should: closed
                raise


def start_peers_gate(config, server, role: str) -> PeersGate:
    """The gate of the started ``server`` (``serve role``), checking the roles the scheduler
    routes to (generation alone in aggregated mode); it prints as ``serve`` does."""
    say = lambda line: print(f"triton-disagg serve {role}: {line}", flush=True)  # noqa: E731
    return PeersGate(_peers(config, role), server.repo, server.grpc_url, server.control,
                     say).start()


def check_before_start(config, repo: Path, role: str) -> None:
    """Render the gate as one check of the peers finds them, before tritonserver starts:
    open when every role answers, so a healthy start loads it READY and logs no error
    (a closed gate's load fails, and Triton logs that as an ERROR); else closed, naming
    the role that does not answer. Either way never open before a check."""
    peers = _peers(config, role).start()
    try:
        reason = peers.missing()
    finally:
        peers.close()
    render_gate(repo, f"{reason}" if reason is not None else "")


def _peers(config, role: str) -> Peers:
    """The members of the roles the scheduler routes to (generation alone when aggregated)."""
    from triton_disagg.routing.pools import member_sources

    from triton_disagg.triton.render import settings

    membership, sources = member_sources(settings("orchestrator", role, config))
    if config.mode == "aggregated":
        del sources["context"]
    return Peers(sources, membership)

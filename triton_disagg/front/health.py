"""``GET /healthz`` (the deployment guide's) and ``GET /health`` (trtllm-serve's): whether
the tritonserver beside this process can serve, as a load balancer or a Kubernetes probe asks.

Every role's server answers them: the HTTP front of ``serve all`` / ``serve scheduler``
(:mod:`.http_front`), and, on ``serve context|generation`` (and a non-decoupled ``serve
all|scheduler``, whose ensemble the front cannot stream), the same process in its
health-only mode (``--health-only``), which serves these two routes and nothing else.

Invariants: 200 ``{"status": "ok"}`` only when tritonserver says it is ready, so does each
model named, and, for a scheduler, its roles gate file (``GATE_ENV``, written by
:mod:`launch.roles_gate`) is empty: every role it routes to has a server that answers; otherwise 503 ``{"status": "unavailable", "reason": ...}`` with a
one-line reason. Every question to tritonserver has ``ASK_TIMEOUT_SECONDS``, and the first
one unanswered ends the check: a tritonserver that does not answer (stopped, hung) is a 503
within that, not a hung probe (Kubernetes gives a probe 1 s by default).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Protocol

from aiohttp import web

ASK_TIMEOUT_SECONDS = 0.4     # per question to tritonserver (server ready, each model ready)
PATHS = ("/healthz", "/health")
GATE_ENV = "TRITON_DISAGG_ROLES_GATE"   # a scheduler's front: where its roles gate file is
CLOSED = ("a role the scheduler routes to has no server that answers (serve's log names "
          "the role)")


class Readiness(Protocol):
    async def ready(self) -> str | None:
        """None when the server can serve, else why not (one line)."""


READINESS = web.AppKey("readiness", Readiness)


class ReadinessClient(Protocol):
    """What :class:`ServerReadiness` asks: a ``tritonclient.grpc.aio`` client's calls."""

    async def is_server_ready(self, *, client_timeout: float | None = None) -> bool: ...

    async def is_model_ready(self, model_name: str, *, client_timeout: float | None = None
                             ) -> bool: ...


class ServerReadiness:
    """Asks a tritonserver (``client``: a ``tritonclient.grpc.aio`` client) whether it and
    each of ``models`` are ready, after the roles gate file ``gate`` (default: the one
    ``GATE_ENV`` names, if any): missing or not empty, not ready. The reason names what is
    not ready, never a peer's address."""

    def __init__(self, client: ReadinessClient, models: tuple[str, ...],
                 gate: Path | None = None):
        self.client, self.models = client, models
        named = os.environ.get(GATE_ENV)
        self.gate = gate or (Path(named) if named else None)
        self._asking: asyncio.Future[str | None] | None = None

    async def ready(self) -> str | None:
        """Callers at once share one check (probes are public and ungated: a flood of them
        costs tritonserver one round of questions at a time); one that leaves does not
        cancel it for the others."""
        if self._asking is None:
            self._asking = asyncio.ensure_future(self._ask())
            self._asking.add_done_callback(self._asked)
        return await asyncio.shield(self._asking)

    def _asked(self, _: asyncio.Future) -> None:
        self._asking = None

    async def _ask(self) -> str | None:
        if self.gate is not None and not _gate_open(self.gate):
            return CLOSED
        ask = {"client_timeout": ASK_TIMEOUT_SECONDS}
        try:
            server = await self.client.is_server_ready(**ask)
            missing = [m for m in self.models if not await self.client.is_model_ready(m, **ask)]
        except Exception as exc:  # noqa: BLE001 - any failure to ask means not ready
            return f"tritonserver does not answer ({type(exc).__name__})"
        if missing:
            return "; ".join(f"the {model} model is not ready" for model in missing)
        return None if server else "tritonserver is not ready"


def _gate_open(path: Path) -> bool:
    try:
        return path.read_text() == ""
    except OSError:         # not written yet: never ready before the first check
        return False


async def health(request: web.Request) -> web.Response:
    reason = await request.app[READINESS].ready()
    if reason is None:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "unavailable", "reason": reason}, status=503)


def add_health_routes(app: web.Application, readiness: Readiness) -> None:
    app[READINESS] = readiness
    for path in PATHS:
        app.router.add_get(path, health)

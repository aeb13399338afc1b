"""Is the server there, ready, and is the model ready? One clear answer before a request.

The probes are Triton's own: ``/v2/health/live``, ``/v2/health/ready`` (every
model of the repository loaded: the endpoint for a load balancer or a
Kubernetes readiness probe) and ``/v2/models/{model}/ready``, or their gRPC
twins. :func:`require_ready` raises :class:`ServerNotReady` (a
:class:`UserError`, so the CLI prints one line) naming which of them failed
and what to do.
"""

from __future__ import annotations

from triton_disagg.errors import UserError

START_HINT = "start one with `triton-disagg serve all --engine DIR`"


class ServerNotReady(UserError):
    """The server is unreachable, still loading, or the model failed to load."""


def _http_status(url: str, path: str, timeout: float) -> int | None:
    """HTTP status of GET ``url + path``; None when nothing answers."""
    import requests

    try:
        return requests.get(f"{url.rstrip('/')}{path}", timeout=timeout).status_code
    except requests.RequestException:
        return None


def probe(url: str, protocol: str, model: str = "ensemble",
          timeout: float = 5.0) -> tuple[bool, bool, bool]:
    """(live, ready, model ready) of the server at ``url`` (http://host:port or host:port)."""
    if protocol == "http":
        live = _http_status(url, "/v2/health/live", timeout) == 200
        ready = live and _http_status(url, "/v2/health/ready", timeout) == 200
        model_ready = live and _http_status(url, f"/v2/models/{model}/ready", timeout) == 200
        return live, ready, model_ready
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        with grpcclient.InferenceServerClient(url) as client:
            live = client.is_server_live(client_timeout=timeout)
            return (live, live and client.is_server_ready(client_timeout=timeout),
                    live and client.is_model_ready(model, client_timeout=timeout))
    except InferenceServerException:
        return False, False, False


def require_ready(url: str, protocol: str, model: str = "ensemble", timeout: float = 5.0) -> None:
    """Return if ``model`` can serve at ``url``; raise :class:`ServerNotReady` otherwise."""
    live, ready, model_ready = probe(url, protocol, model, timeout)
    if not live:
        raise ServerNotReady(f"no Triton server answers at {url} ({protocol}); check the address "
                             f"and port, or {START_HINT}")
    if not model_ready:
        raise ServerNotReady(f"the server at {url} is up but model {model!r} is not ready (still "
                             f"loading, or it failed to load: see the server log); retry shortly")
    if not ready:
        raise ServerNotReady(f"the server at {url} is up but not ready (a model is still loading "
                             f"or failed to load: see the server log); retry shortly")

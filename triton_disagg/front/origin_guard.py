"""Who may drive the HTTP front from a browser: a web page must not be able to call a front
on the user's machine or network (a cross-site ``fetch``, or DNS rebinding, where a name the
page controls resolves to 127.0.0.1).

The rule, for every path:

- a request carrying an ``Origin`` header (browsers send one on every cross-origin request
  and on every POST) is refused with 403 unless that origin is in
  ``front.allowed_origins`` (exact ``scheme://host[:port]``, or ``"*"``); an allowed one gets
  ``Access-Control-Allow-Origin`` back. API clients (the OpenAI SDK, curl, requests) send
  no ``Origin`` and are not affected;
- when the front listens on a loopback address, or ``front.allowed_hosts`` is set, the
  ``Host`` header's name must be a loopback one (``localhost``, 127.0.0.0/8, ``::1``) or in
  ``front.allowed_hosts``, else 403: a rebound name never matches. A front on a routable
  address with no ``allowed_hosts`` accepts any Host (it is reached under names it cannot
  know).
"""

from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web

from triton_disagg.config.front_section import FrontConfig
from triton_disagg.config.values import is_loopback
from triton_disagg.front.openai_api import ApiError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ALLOWED_ORIGIN = web.RequestKey("allowed_origin", str)


def host_name(host_header: str) -> str:
    """``Host``'s name without its port: ``[::1]:80`` -> ``::1``, ``a.b:80`` -> ``a.b``."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def add_origin_guard(app: web.Application, config: FrontConfig, bound_host: str) -> None:
    """Enforce the module's rule on ``app`` (a front listening on ``bound_host``): a
    middleware after those ``app`` has, and the allowed origin echoed on every response."""
    origins = set(config.allowed_origins)
    hosts = {h.lower() for h in config.allowed_hosts}
    check_host = bool(hosts) or is_loopback(bound_host)

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin is not None and origin not in origins and "*" not in origins:
            raise ApiError(f"requests from origin {origin[:100]!r} are refused; add it to "
                           f"front.allowed_origins to allow it", 403, kind="permission_error")
        host = request.headers.get("Host")
        if check_host and host is not None:
            name = host_name(host).lower()
            if not is_loopback(name) and name not in hosts:
                raise ApiError(f"Host {host[:100]!r} is not a name of this server; add it to "
                               f"front.allowed_hosts to allow it", 403, kind="permission_error")
        if origin is not None:
            request[ALLOWED_ORIGIN] = origin
        return await handler(request)

    async def allow_origin(request: web.Request, response: web.StreamResponse) -> None:
        if ALLOWED_ORIGIN in request:
            response.headers["Access-Control-Allow-Origin"] = request[ALLOWED_ORIGIN]
            response.headers["Vary"] = "Origin"

    app.middlewares.append(guard)
    app.on_response_prepare.append(allow_origin)

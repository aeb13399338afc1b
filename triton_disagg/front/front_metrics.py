"""The HTTP front's own metrics at ``GET /metrics``, in Prometheus' text format (0.0.4),
beside Triton's on its metrics port: requests by route and status, requests in flight, and
refusals by the admission caps (:mod:`.admission`).

Invariants: every label value comes from a bounded set (a route's pattern, never its path:
an unknown path counts as ``unmatched``; an HTTP status; a cap's name), so no client can
grow the exposition; a request counts once, when it ends, ``client_closed`` when the
client left first; in flight goes back down on every way out.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from aiohttp import web

PREFIX = "disagg_front"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REQUEST_CAP, CONNECTION_CAP = "max_concurrent_requests", "max_connections"


class FrontMetrics:
    """The counts, and the middleware that keeps them."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()     # (route, status) -> ended
        self.refusals: Counter[str] = Counter({REQUEST_CAP: 0, CONNECTION_CAP: 0})
        self.in_flight = 0

    def refused_connection(self) -> None:
        """A connection past ``front.max_connections`` (the runner's hook)."""
        self.refusals[CONNECTION_CAP] += 1

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        self.in_flight += 1
        status = "client_closed"
        try:
            response = await handler(request)
            status = str(response.status)
            return response
        except web.HTTPException as exc:
            status = str(exc.status)
            raise
        except (ConnectionError, asyncio.CancelledError):
            raise
        finally:
            self.in_flight -= 1
            self.requests[(route, status)] += 1
            if status == "429":
                self.refusals[REQUEST_CAP] += 1

    def exposition(self) -> str:
        lines = [f"# HELP {PREFIX}_requests_total HTTP requests the front answered, by route "
                 f"and status", f"# TYPE {PREFIX}_requests_total counter"]
        lines += [f'{PREFIX}_requests_total{{route="{route}",status="{status}"}} {n}'
                  for (route, status), n in sorted(self.requests.items())]
        lines += [f"# HELP {PREFIX}_requests_in_flight HTTP requests being answered now",
                  f"# TYPE {PREFIX}_requests_in_flight gauge",
                  f"{PREFIX}_requests_in_flight {self.in_flight}",
                  f"# HELP {PREFIX}_refusals_total requests (429) and connections (503) "
                  f"refused by an admission cap", f"# TYPE {PREFIX}_refusals_total counter"]
        lines += [f'{PREFIX}_refusals_total{{cap="{cap}"}} {n}'
                  for cap, n in sorted(self.refusals.items())]
        return "\n".join(lines) + "\n"


def add_metrics_route(app: web.Application, metrics: FrontMetrics) -> None:
    """``GET /metrics`` on ``app``, and the counting middleware outermost."""
    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition().encode(),
                            headers={"Content-Type": CONTENT_TYPE})
    app.middlewares.insert(0, metrics.middleware)
    app.router.add_get("/metrics", serve)

"""The HTTP front: one asyncio (aiohttp) process beside tritonserver, started by every ``serve``
(``python -m triton_disagg.front.http_front``; see :mod:`triton_disagg.launch.front_process`).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (OpenAI; SSE with ``"stream":
true``, ending ``data: [DONE]``), ``POST /v1/inference`` (the deployment guide's; these three:
:mod:`.generation_routes`), ``GET
/v1/models`` and ``/v1/models/{id}``, ``GET /metrics`` (the front's own:
:mod:`.http_gates`), ``GET /openapi.json`` (:mod:`.openapi`), ``GET /healthz`` and
``/health`` (200 when tritonserver and its models are ready, else 503 with the reason:
:mod:`.health`), ``GET /version``, vLLM's ``GET /tokenizer_info``, ``POST /tokenize`` and
``/detokenize`` (:mod:`.tokenizer_routes`). With ``--health-only`` (``serve context|generation``,
and a non-decoupled ``serve all|scheduler``) it serves ``/healthz``, ``/health`` and
``/metrics`` alone and needs no engine. Either way it is ready while tritonserver and the
models named by ``--models`` (serve names the repository's) are.

Invariants: every error is OpenAI's error JSON with a 4xx for the request's mistakes (bad
JSON, wrong types, unknown fields, a body over ``MAX_BODY_BYTES``: 413, a body too slow: 408,
a model not served: 404, a foreign Origin or Host: 403, :mod:`.http_gates`) and 5xx for
the server's (503 when a role is missing or the server is not ready); a timeout is 504
(:class:`~triton_disagg.front.orchestrator_call.OrchestratorError`); a 5xx body says what kind of
fault and the request id, never an internal address or exception text (the front's log
has those, with the request id); past a cap (:mod:`.http_gates`) a request is 429 and a
connection 503, both with ``Retry-After``; a request that fails leaves the process
serving; the client's ``X-Request-Id`` (or a new one) is the Triton request id of the
orchestrator call and comes back in the response header; a
client that disconnects cancels its handler (``handler_cancellation``), which cancels the
gRPC stream, which the orchestrator sees and stops generation, freeing the KV blocks; a
stream that fails part-way ends with an error event and no ``[DONE]``, never a normal
finish. The process exits when its parent (``serve``) is gone.

With ``--door-grpc PORT:INNER`` (and ``--door-http PORT:INNER``) it also answers Triton's
public gRPC (and HTTP) port on ``--host`` and forwards to tritonserver's on loopback,
bounding every message to ``MAX_BODY_BYTES`` (:mod:`.public_door`); then the ``--grpc-*``
TLS flags are the door's, and ``--grpc-url`` (loopback) is dialled in clear. With
``--door-metrics PORT:INNER`` (every role whose tritonserver has metrics) it answers ``GET
/metrics`` on the metrics port from tritonserver's on loopback (:mod:`.metrics_door`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import sys
from pathlib import Path
from typing import Awaitable, Callable

from aiohttp import web

from triton_disagg import __version__
from triton_disagg.config.front_section import FrontConfig, add_front_flags, front_from_flags
from triton_disagg.config.tls_section import GrpcTLS, add_tls_flags, tls_from_flags
from triton_disagg.front.http_gates import (CappedRunner, FrontMetrics, RequestCount,
                                           add_metrics_route, add_origin_guard, request_gate)
from triton_disagg.front.generation_routes import (CALLS, FRONT, PREPARER, RELAY,
                                                   chat_completions, completions, inference,
                                                   openai_errors)
from triton_disagg.front.health import Readiness, ServerReadiness, add_health_routes
from triton_disagg.front.openai_api import BODY_BOUNDS, MAX_BODY_BYTES, ApiError, BodyBounds
from triton_disagg.front.openapi import document
from triton_disagg.front.orchestrator_call import Relay, RequestEncoder
from triton_disagg.front.metrics_door import make_metrics_door
from triton_disagg.front.http_door import DoorPorts, open_doors
from triton_disagg.front.tokenizer_routes import add_tokenizer_routes, tokenizer_posts
from triton_disagg.triton.grpc_channel import client_options

PARENT_POLL_SECONDS = 1.0
SHUTDOWN_SECONDS = 5.0
log = logging.getLogger("triton_disagg.front")

METRICS = web.AppKey("metrics", FrontMetrics)
OPENAPI = web.AppKey("openapi", bytes)    # the document, made once (pydantic: ~5 ms)
PARENT_WATCH = web.AppKey("parent_watch", asyncio.Task)


def _model_card(preparer: RequestEncoder) -> dict:
    """The served model as OpenAI's (and vLLM's: ``root``, ``max_model_len``) model object."""
    return {"id": preparer.model, "object": "model", "created": 0, "owned_by": "triton-disagg",
            "root": preparer.model, "parent": None, "max_model_len": preparer.max_seq_len}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[PREPARER])]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}`` (the SDK's ``models.retrieve``): the served one, else 404."""
    preparer, name = request.app[PREPARER], request.match_info["model"]
    if name != preparer.model:
        raise ApiError(f"model '{name[:100]}' not found; this server serves '{preparer.model}'",
                       status=404, param="model", kind="not_found_error")
    return web.json_response(_model_card(preparer))


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI], content_type="application/json")


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__, "model": request.app[PREPARER].model})


def make_health_app(readiness: Readiness, front: FrontConfig = FrontConfig(),
                    bound_host: str = "127.0.0.1") -> web.Application:
    """``/healthz`` and ``/health`` answered by ``readiness`` (:mod:`.health`), errors as
    OpenAI's error JSON, Origin and Host checked (:mod:`.http_gates`) for a front that
    listens on ``bound_host``: the health-only front, and what the whole front starts from."""
    app = web.Application(middlewares=[openai_errors], client_max_size=MAX_BODY_BYTES)
    app[FRONT], app[METRICS] = front, FrontMetrics()
    add_origin_guard(app, front, bound_host)
    add_health_routes(app, readiness)
    add_metrics_route(app, app[METRICS])
    return app


def make_app(preparer: RequestEncoder, relay: Relay, front: FrontConfig = FrontConfig(),
             bound_host: str = "127.0.0.1") -> web.Application:
    """The whole front: generation through ``relay``, which also says whether it is ready,
    at most ``front.max_concurrent_requests`` at a time (:mod:`.http_gates`)."""
    app = make_health_app(relay, front, bound_host)
    app[CALLS] = RequestCount(front.max_concurrent_requests)
    app.middlewares.append(request_gate(app[CALLS]))
    app[PREPARER], app[RELAY] = preparer, relay
    app[BODY_BOUNDS] = BodyBounds.of(preparer.limits, preparer.max_prompt_chars)
    app[OPENAPI] = json.dumps(document(preparer.limits, tokenizer_posts(preparer))).encode()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/inference", inference)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)   # ids may hold "/"
    app.router.add_get("/version", version)
    app.router.add_get("/openapi.json", openapi)
    add_tokenizer_routes(app, preparer)

    async def close_relay(app: web.Application) -> None:
        await app[RELAY].close()
    app.on_cleanup.append(close_relay)
    return app


def _health_only_app(grpc_url: str, models: tuple[str, ...], front: FrontConfig,
                     bound_host: str, tls: GrpcTLS | None) -> web.Application:
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url, **client_options(tls))  # on its loop
    app = make_health_app(ServerReadiness(client, models), front, bound_host)

    async def close_client(app: web.Application) -> None:
        await client.close()
    app.on_cleanup.append(close_client)
    return app


async def _exit_with_parent(parent: int) -> None:
    """serve stops this process; should serve be killed, this notices and exits."""
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_POLL_SECONDS)
    log.warning("parent %d is gone; exiting", parent)
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m triton_disagg.front.http_front",
                                description="The HTTP front (OpenAI API, /v1/inference, /healthz)")
    p.add_argument("--engine", type=Path, help="engine directory (tokenizer); the whole front")
    p.add_argument("--model-name", help="the model id clients send; the whole front")
    p.add_argument("--health-only", action="store_true",
                   help="serve /healthz and /health alone (no engine needed)")
    p.add_argument("--models", default="",
                   help="comma-separated models that must be ready too (the repository's)")
    p.add_argument("--grpc-url", required=True, help="tritonserver gRPC host:port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--log", type=Path, help="log file (default: stderr)")
    p.add_argument("--door-grpc", metavar="PORT:INNER", type=_port_pair,
                   help="answer Triton's gRPC on --host:PORT, forwarding to 127.0.0.1:INNER")
    p.add_argument("--door-http", metavar="PORT:INNER", type=_port_pair,
                   help="answer Triton's HTTP on --host:PORT, forwarding to 127.0.0.1:INNER")
    p.add_argument("--door-peers", action="store_true",
                   help="the gRPC door faces the deployment's orchestrators (context, "
                        "generation): no cap on calls")
    p.add_argument("--door-metrics", metavar="PORT:INNER", type=_port_pair,
                   help="answer GET /metrics on --host:PORT from tritonserver's metrics on "
                        "127.0.0.1:INNER")
    add_front_flags(p)
    add_tls_flags(p)
    args = p.parse_args(argv)
    if not args.health_only and (args.engine is None or args.model_name is None):
        p.error("the whole front needs --engine and --model-name (or pass --health-only)")
    logging.basicConfig(filename=args.log, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _open_files_to_the_hard_limit()
    front, tls = front_from_flags(args), tls_from_flags(args)
    door = None if args.door_grpc is None else DoorPorts(
        args.host, *args.door_grpc, *(args.door_http or (None, None)))
    inner_tls = None if door else tls       # behind the door tritonserver speaks in clear
    preparer = None if args.health_only else RequestEncoder(args.engine, args.model_name)
    models = tuple(m for m in args.models.split(",") if m)
    parent = os.getppid()

    async def start_watch(app: web.Application) -> None:
        app[PARENT_WATCH] = asyncio.get_running_loop().create_task(_exit_with_parent(parent))

    async def serve() -> None:
        # the gRPC channel needs the loop
        app = _health_only_app(args.grpc_url, models, front, args.host, inner_tls) \
            if preparer is None else make_app(preparer, Relay(args.grpc_url, models, inner_tls),
                                              front, args.host)
        app.on_startup.append(start_watch)
        def runner(door_app: web.Application) -> web.AppRunner:
            return _runner(door_app, front, app[METRICS])

        closers = [] if door is None else [await open_doors(
            door, MAX_BODY_BYTES, front, tls, runner, capped=not args.door_peers,
            models=frozenset(models))]
        if args.door_metrics is not None:
            closers.append(await _open_metrics_door(args.host, *args.door_metrics, runner))
        try:
            await _serve(app, args.host, args.port, front)
        finally:
            for close in closers:
                await close()

    try:
        asyncio.run(serve())
    except (web.GracefulExit, KeyboardInterrupt):     # SIGTERM / SIGINT: stopped cleanly
        pass
    return 0


async def _open_metrics_door(host: str, port: int, inner: int,
                             runner: Callable[[web.Application], web.AppRunner]
                             ) -> Callable[[], Awaitable[None]]:
    """Serve the metrics door (:mod:`.metrics_door`) on ``host:port`` with ``runner``;
    returns what stops it."""
    served = runner(make_metrics_door(inner))
    await served.setup()
    await web.TCPSite(served, host, port).start()
    return served.cleanup


def _open_files_to_the_hard_limit() -> None:
    """Raise this process's soft limit on open files to the hard one: the front's and the
    door's connections share it, and a common soft default (1024) would let a client's idle
    connections take the descriptors every other route needs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _port_pair(text: str) -> tuple[int, int]:
    """``PORT:INNER`` -> (PORT, INNER)."""
    public, inner = text.split(":")
    return int(public), int(inner)


def _runner(app: web.Application, front: FrontConfig, metrics: FrontMetrics,
            handle_signals: bool = False) -> CappedRunner:
    """A runner for ``app`` with the connection cap and write timeout of
    :class:`~triton_disagg.front.http_gates.CappedRunner` and the idle timeout of ``front``,
    its refusals counted in ``metrics``."""
    return CappedRunner(app, front.max_connections, front.write_timeout_seconds,
                        metrics.refused_connection, metrics.stalled_connection,
                        handle_signals=handle_signals, auto_decompress=False,  # read_json: 415
                        handler_cancellation=True, access_log=None,
                        keepalive_timeout=front.idle_timeout_seconds,
                        shutdown_timeout=SHUTDOWN_SECONDS)


async def _serve(app: web.Application, host: str, port: int, front: FrontConfig) -> None:
    """Serve ``app`` on ``host:port`` until cancelled (aiohttp's ``run_app``, with
    :func:`_runner`)."""
    runner = _runner(app, front, app[METRICS], handle_signals=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("serving on http://%s:%d (%s)", host, port, front)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())

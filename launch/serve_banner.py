"""What ``serve`` prints once its server is up: the endpoints a client or peer uses (a
wildcard bind shown as loopback), the public door, the KV event publishers, where a
scheduler finds this server or what it routes over, and a first request to try."""

from __future__ import annotations

from triton_disagg.config.roles import ENGINE_ROLES, Role
from triton_disagg.front.openai_api import MAX_BODY_BYTES
from triton_disagg.triton.endpoints import reachable

from .front_process import health_only


def announce(role: str, config, endpoints, advertised: str | None, server,
              registration, front: int, kv_events: tuple[str, ...] = ()) -> None:
    """Print what ``serve role`` serves now: its endpoints (``shown`` at an address this
    host reaches), the public door when it has one, its KV event publishers ``kv_events``,
    where the scheduler finds it (or routes), and curl lines to try."""
    shown = reachable(endpoints.host)
    state = "up" if role == Role.SCHEDULER else "ready"   # the gate says when it is ready
    lines = [f"triton-disagg serve {role}: {state} ({config.mode}, engine {config.engine})"]
    if endpoints.http_port is not None:
        lines.append(f"  HTTP     http://{shown}:{endpoints.http_port}")
    lines.append(f"  gRPC     {shown}:{endpoints.grpc_port}")
    if endpoints.behind_door:
        lines.append(f"  (the public door: messages over {MAX_BODY_BYTES // 2**20} MiB refused; "
                     f"tritonserver itself on {server.grpc_url})")
    if endpoints.metrics_port is not None:
        lines.append(f"  metrics  http://{shown}:{endpoints.metrics_port}/metrics")
    if health_only(role, config):
        lines.append(f"  health   http://{shown}:{front}/healthz")
    else:
        lines.append(f"  front    http://{shown}:{front}  (OpenAI /v1/completions, "
                     f"/v1/chat/completions, /v1/models; /v1/inference; /healthz)")
    lines.append(f"  log      {server.log_path}")
    if kv_events:
        lines.append(f"  kv events {', '.join(kv_events)}  (ZeroMQ PUB, vLLM's KV event format)")
    if role == Role.SCHEDULER:
        lines.append(f"  routes   {pools_line(config)}")
        lines.append("  ready    /healthz answers 200 while every role has a server that answers")
    if role in (Role.ALL, Role.SCHEDULER) and endpoints.http_port is not None:
        lines.append(f"try:\n  curl -s -X POST http://{shown}:{endpoints.http_port}/v2/models/ensemble/"
                     f"generate -d '{{\"text_input\": \"The quick brown fox\", \"max_tokens\": 20}}'")
        if not health_only(role, config):
            lines.append(f"  curl -s http://{shown}:{front}/v1/completions -H 'Content-Type: "
                         f"application/json' -d '{{\"model\": \"{config.served_model_name}\", "
                         f"\"prompt\": \"The quick brown fox\", \"max_tokens\": 20}}'")
    elif registration is not None:
        lines.append(f"  advertised {advertised}")
        lines.append(f"  etcd     {registration.key} on {config.discovery.etcd} (lease "
                     f"{config.discovery.ttl_seconds} s; the scheduler finds it there)")
    elif role in ENGINE_ROLES:
        lines.append(f"  advertised {advertised}; the scheduler dials "
                     f"{config.server(role).url or advertised}")
    lines.append("Ctrl-C stops the server.")
    print("\n".join(lines), flush=True)


def pools_line(config) -> str:
    """What the scheduler routes over, per role: "context: 2 urls (least_loaded); ..."."""
    roles = config.engine_roles
    where = {role: (f"etcd {config.discovery.etcd} {config.discovery.prefix}/{role}/"
                    if config.discovery else f"{len(config.server(role).urls)} url(s)")
             for role in roles}
    return "; ".join(f"{role}: {where[role]} ({config.server(role).router})" for role in roles)

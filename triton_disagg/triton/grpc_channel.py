"""The gRPC channel options of every client this project keeps open to a tritonserver
(the orchestrator's calls to context and generation, the scheduler's peer probes, the
HTTP front's relay and health checks).

gRPC backs off between reconnection attempts, 1 s growing by 1.6x up to 120 s: a cached
channel to a server that was down for a few minutes stays in TRANSIENT_FAILURE, failing
every call at once with "Connection refused", for up to two minutes after the server is
back (measured: a scheduler ready ~65 s and serving ~80 s after its generation server
returned, issue 27). Reconnection here backs off at most ``MAX_RECONNECT_BACKOFF_MS``, so
a channel notices a returning server within about a second; a dead server costs a
connection attempt a second per channel, nothing more.

Messages either way are bounded at ``MAX_MESSAGE_BYTES`` (tritonclient's default is
2 GiB): the largest this deployment sends or answers is a prompt's log-probs with their
top-20 alternatives (ids and values) at a 128k-token ``max_context``, about 40 MB, and a
peer that answers more is refused by gRPC (RESOURCE_EXHAUSTED) before it is held in memory.

Invariant: options are tritonclient's defaults (keepalive as given or off) plus the message
bound and the backoff bounds; with the config's ``grpc_tls`` every such client speaks TLS
(:func:`client_options`).
"""

from __future__ import annotations

from typing import Any
# Any here: grpc client keyword values (tritonclient's own are untyped).

from triton_disagg.config.tls_section import GrpcTLS

INITIAL_RECONNECT_BACKOFF_MS = 250
MAX_RECONNECT_BACKOFF_MS = 1000
MAX_MESSAGE_BYTES = 256 * 2**20        # sent or received, per message (module docstring)


def channel_args(keepalive=None) -> list[tuple[str, int]]:
    """Options for ``InferenceServerClient(url, channel_args=...)`` (sync or asyncio);
    ``keepalive``: a ``tritonclient.grpc.KeepAliveOptions``, tritonclient's default (no
    pings) when None."""
    from tritonclient.grpc import KeepAliveOptions

    keepalive = keepalive or KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", int(keepalive.keepalive_permit_without_calls)),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
        ("grpc.min_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


def client_options(tls: GrpcTLS | None, keepalive=None) -> dict[str, Any]:
    """Keyword arguments for ``InferenceServerClient(url, **...)`` (sync or asyncio): the
    channel options, and TLS when ``tls`` (the config's ``grpc_tls``) is given."""
    return {"channel_args": channel_args(keepalive), **(tls.client_kwargs() if tls else {})}

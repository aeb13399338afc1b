"""Every serving error, in one module that imports nothing of the package, so that any
layer may raise or catch them without importing another layer.

- :class:`UserError`: a mistake in input, config or files; the CLI prints it as one line
  and exits with code 2.
- :class:`RequestError`: one request's mistake (what the engine, a model or the front end
  refuses); the model answers that request with the message, the others go on.
- :class:`EngineError` and its kinds: context or generation could not serve a request
  (an error answer, back-pressure, a lost or missing server); the orchestrator passes
  the message to the client.

Each class names its Triton status (``status``, a ``pb_utils.TritonError`` code name), so a
client tells its own mistake (INVALID_ARG: HTTP 400, gRPC INVALID_ARGUMENT) from a server
that cannot serve now (UNAVAILABLE: 503 / UNAVAILABLE; :class:`Unavailable` and its kinds)
and a fault (INTERNAL: 500 / INTERNAL). A timeout (:class:`Timeout`) is UNAVAILABLE to Triton
too, and its message says so in words, which the HTTP front turns into 504.

Invariant: a message is one line naming what is wrong and, where there is one, the fix;
it reaches the client unchanged. The KV transfer's own errors live in :mod:`triton_disagg.kv`.
"""


class UserError(Exception):
    """A mistake in input, config or files, with a message naming what is wrong and the fix."""

    status = "INVALID_ARG"


class RetryableStart(UserError):
    """A server start that failed for a cause the next start need not meet (a stub Triton
    gave up on while the host was busy, a server killed by a signal while it loaded):
    ``serve`` starts tritonserver again for it, within its restarts, instead of exiting."""


class RequestError(UserError):
    """A request that cannot be served as sent (bad input tensor, empty prompt, bad token id,
    too long, duplicate id): sent back as that request's Triton error."""


class EngineError(RuntimeError):
    """Context or generation answered with an error (message passed to the client)."""

    status = "INTERNAL"


class Unavailable(EngineError):
    """No server can serve the request now: lost, none left, at its most requests, or
    silent past its deadline (:class:`Timeout`)."""

    status = "UNAVAILABLE"


class Timeout(Unavailable):
    """A server did not answer within its deadline. Triton's python backend has no
    DEADLINE_EXCEEDED code, so it leaves as UNAVAILABLE, and a gRPC stream's error carries no
    code at all: what tells a timeout apart is its message, which always holds ``MARK``
    (added when the words given lack it); the HTTP front answers such a message with 504."""

    MARK = "timed out"

    def __init__(self, message: str):
        super().__init__(message if self.MARK in message else f"{message} ({self.MARK})")


class ServerBusy(Unavailable):
    """An orchestrator instance already serves its most requests at once
    (``scheduler_server.max_concurrent_requests``): one more is refused at once, not queued."""


class GenerationLost(Unavailable):
    """The generation server at ``url`` is gone with the request (the orchestrator moves
    the request to another: :mod:`triton_disagg.front.orchestrator`)."""

    def __init__(self, url: str, reason: str):
        self.url = url
        super().__init__(f"generation server {url} was lost ({reason})")


class NoServer(Unavailable):
    """No member of the role is left to route to (one line, naming the role and urls)."""

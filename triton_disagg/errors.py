"""Every serving error, in one module that imports nothing of the package, so that any
layer may raise or catch them without importing another layer.

- :class:`UserError`: a mistake in input, config or files; the CLI prints it as one line
  and exits with code 2.
- :class:`RequestError`: one request's mistake (what the engine, a model or the front end
  refuses); the model answers that request with the message, the others go on.
- :class:`EngineError` and its kinds: context or generation could not serve a request
  (an error answer, back-pressure, a lost or missing server); the orchestrator passes
  the message to the client.

Each class names its :class:`ErrorCode` (``status``): the one thing every seam carries and
maps, never the message. Across Triton it is the error's status (a ``pb_utils.TritonError``
code, read back from tritonclient's status: :func:`triton_status`, :func:`from_grpc_status`;
on the HTTP front's stream, whose errors carry no status, a ``[CODE] `` tag it asked for:
:func:`with_code`); across ZeroMQ a field of the error event (:mod:`triton_disagg.token_wire`); at the HTTP front
an HTTP status (:data:`HTTP_STATUS`). A client's mistake is INVALID_ARG (HTTP 400, gRPC
INVALID_ARGUMENT), a server that cannot serve now UNAVAILABLE (503, :class:`Unavailable` and
its kinds), a deadline that passed TIMEOUT (504, :class:`Timeout`), a fault INTERNAL (500).

Invariant: a message is one line naming what is wrong and, where there is one, the fix;
it reaches the client unchanged. The KV transfer's own errors live in :mod:`triton_disagg.kv`.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """What kind of failure an error is. The names are Triton's ``pb_utils.TritonError`` codes
    where Triton has one; TIMEOUT is gRPC's DEADLINE_EXCEEDED, which the python backend cannot
    raise: it leaves a model as UNAVAILABLE with :data:`TIMEOUT_TAG` before its message
    (:func:`triton_status`), and only an UNAVAILABLE status so tagged reads back as TIMEOUT
    (:func:`from_triton`)."""

    INVALID_ARG = "INVALID_ARG"      # the request's own mistake
    UNAVAILABLE = "UNAVAILABLE"      # no server can serve it now: retry later
    TIMEOUT = "TIMEOUT"              # a server let its deadline pass
    CANCELLED = "CANCELLED"          # the client went away or stopped it
    INTERNAL = "INTERNAL"            # a fault of the server

    def __str__(self) -> str:
        return self.value


# code -> the HTTP status a client is answered with (503 comes with Retry-After); 499 is
# nginx's "client closed request": nobody reads it, but it is logged and counted as such.
HTTP_STATUS = {ErrorCode.INVALID_ARG: 400, ErrorCode.UNAVAILABLE: 503, ErrorCode.TIMEOUT: 504,
               ErrorCode.CANCELLED: 499, ErrorCode.INTERNAL: 500}
TIMEOUT_TAG = "TIMEOUT: "   # a TIMEOUT's message as a Triton error starts with it (ErrorCode)
# A request parameter (true): answer an error with its code in the message (with_code).
CODE_IN_MESSAGE = "disagg_code_in_message"   # not triton_*: Triton reserves it
# gRPC status (tritonclient's ``InferenceServerException.status()``: "StatusCode.<NAME>", or
# ``grpc.StatusCode.<NAME>.name``) -> code; the rest are INTERNAL. NOT_FOUND: the server lacks
# a model it should serve (not loaded yet, or unloaded), the deployment's fault, not the request's.
_FROM_GRPC = {"INVALID_ARGUMENT": ErrorCode.INVALID_ARG, "UNAVAILABLE": ErrorCode.UNAVAILABLE,
              "NOT_FOUND": ErrorCode.UNAVAILABLE, "DEADLINE_EXCEEDED": ErrorCode.TIMEOUT,
              "CANCELLED": ErrorCode.CANCELLED}


def triton_status(code: ErrorCode, message: str) -> tuple[str, str]:
    """``(pb_utils.TritonError code name, message)`` of an error ``code`` leaving a model.
    The tag is reserved: a message of another code that starts with it leaves without it."""
    if code is ErrorCode.TIMEOUT:
        return ErrorCode.UNAVAILABLE.value, TIMEOUT_TAG + without_tag(message)
    return code.value, without_tag(message)


def from_triton(status: str, message: str) -> ErrorCode:
    """The code of a Triton error whose ``pb_utils.TritonError`` code is named ``status``
    (inverse of :func:`triton_status`; a name not in :class:`ErrorCode` is INTERNAL)."""
    if status == ErrorCode.UNAVAILABLE.value and message.startswith(TIMEOUT_TAG):
        return ErrorCode.TIMEOUT
    return ErrorCode.__members__.get(status, ErrorCode.INTERNAL)


def from_grpc_status(status: str | None, message: str) -> ErrorCode:
    """The code of a Triton error read over gRPC: ``status`` as tritonclient gives it
    ("StatusCode.INVALID_ARGUMENT"; None, an exception tritonclient made without one:
    INTERNAL)."""
    name = (status or "").removeprefix("StatusCode.")
    code = _FROM_GRPC.get(name, ErrorCode.INTERNAL)
    return from_triton(code.value, message) if code is ErrorCode.UNAVAILABLE else code


def without_tag(message: str) -> str:
    """A Triton error's message as its model meant it (:data:`TIMEOUT_TAG` dropped)."""
    return message.removeprefix(TIMEOUT_TAG)


def with_code(code: ErrorCode, message: str) -> str:
    """``[CODE] message``: an error's code carried in its message, for a caller that asked
    for it (:data:`CODE_IN_MESSAGE`) because the error reaches it without a status (a
    Triton stream's error message); :func:`code_in` reads it back."""
    return f"[{code.value}] {message}"


def code_in(message: str) -> tuple[ErrorCode | None, str]:
    """``(code, message)`` of a message :func:`with_code` wrote, a :data:`TIMEOUT_TAG`
    before it dropped (:func:`without_tag`); one without a code: ``(None, message)``."""
    message = without_tag(message)
    name, sep, rest = message.partition("] ")
    if name.startswith("[") and sep and name[1:] in ErrorCode.__members__:
        return ErrorCode[name[1:]], rest
    return None, message


def code_of(exc: BaseException) -> ErrorCode:
    """``exc``'s code: its ``status`` when it is one of this module's, else INTERNAL."""
    status = getattr(exc, "status", None)
    return status if isinstance(status, ErrorCode) else ErrorCode.INTERNAL


def error_for(code: ErrorCode, message: str) -> Exception:
    """An error answer with ``code`` as the class of this module that carries it."""
    return _CLASS_OF[code](message)


class UserError(Exception):
    """A mistake in input, config or files, with a message naming what is wrong and the fix."""

    status = ErrorCode.INVALID_ARG


class RetryableStart(UserError):
    """A server start that failed for a cause the next start need not meet (a stub Triton
    gave up on while the host was busy, a server killed by a signal while it loaded, a port
    picked behind the door that something took before tritonserver bound it):
    ``serve`` starts tritonserver again for it, within its restarts, instead of exiting."""


class RequestError(UserError):
    """A request that cannot be served as sent (bad input tensor, empty prompt, bad token id,
    too long, duplicate id): sent back as that request's Triton error."""


class EngineError(RuntimeError):
    """Context or generation answered with an error (message passed to the client)."""

    status = ErrorCode.INTERNAL


class Unavailable(EngineError):
    """No server can serve the request now: lost, none left, at its most requests, or
    silent past its deadline (:class:`Timeout`)."""

    status = ErrorCode.UNAVAILABLE


class Timeout(Unavailable):
    """A server did not answer within its deadline (TIMEOUT: 504 at the HTTP front)."""

    status = ErrorCode.TIMEOUT


class Cancelled(EngineError):
    """The request was stopped before it ended (its client went away, or cancelled it)."""

    status = ErrorCode.CANCELLED


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


_CLASS_OF: dict[ErrorCode, type[Exception]] = {
    ErrorCode.INVALID_ARG: RequestError, ErrorCode.UNAVAILABLE: Unavailable,
    ErrorCode.TIMEOUT: Timeout, ErrorCode.CANCELLED: Cancelled, ErrorCode.INTERNAL: EngineError}

"""Token events on ZeroMQ between generation and the orchestrator: the messages (msgpack)
and generation's sockets.

The messages: two kinds, each one msgpack map with the schema version under ``"v"``:

- a token message (generation -> an orchestrator's token address): every event
  (:class:`~triton_disagg.engine.sequence.TokenEvent`) of one decode step for that address,
  ``{"v": 3, "events": [event, ...]}``, where an event is the event itself, packed as it is:
  a map of its fields by their names, ``{"request_id": str, "key": the request's key,
  "seq": int, "tokens": [int, ...]}`` plus, only when they are not at their default,
  ``"log_probs": [float, ...]`` (the request asked for them), ``"top": [[[id, ...],
  [float, ...]], ...]`` (one :class:`~triton_disagg.engine.logprobs.TopLogprobs` per token,
  its fields in order: its ``k <= MAX_LOGPROBS`` most likely alternatives and their
  log-probs; the request asked for ``top_logprobs``), ``"finish_reason"`` (a
  :data:`~triton_disagg.protocol.FinishReason`; its last event) or ``"error": message``
  and ``"code"``: its :class:`~triton_disagg.errors.ErrorCode` name (its last event; left
  out for INTERNAL, and a name this side does not know reads as INTERNAL too). The
  response fields (``text`` and the counts) are the orchestrator's and never travel here;
- a stop (orchestrator -> the control address of the generation instance holding the
  request): ``{"v": 3, "stop": request id, "key": the request's key}``.

A request's key is a random string the orchestrator makes for it and sends generation
inside the token address (``<address>#<key>``, :func:`with_key`); knowing a request id
is not enough to add to its stream or end it. ``seq`` numbers a request's events from
generation 0, 1, 2, ... so the receiver sees a lost one.

Invariants of the messages: decoding never runs code (msgpack only; a tcp socket can be
reached from other hosts, so nothing here is pickle); every frame that is not a well-formed message
of this version raises :class:`WireError` naming what is wrong (a key that is not ASCII or
longer than ``MAX_KEY_CHARS`` included: keys are made short and ASCII); a reader sets
its socket's ``MAXMSGSIZE`` to ``MAX_TOKEN_FRAME_BYTES`` / ``MAX_STOP_FRAME_BYTES``, so
ZeroMQ drops a larger frame (and the peer's connection) before it is read; an event is
final exactly when it carries ``finish`` or ``error``; keys are compared with
:func:`same_key` (constant time, any content).

Generation's side (the orchestrator's token socket is :mod:`triton_disagg.front.token_inbox`):

- :class:`TokenOutbox` groups the token events of one decode step by orchestrator
  address and sends one message per address (PUSH, one socket per address, cached);
- :class:`StopInbox` is the instance's control socket (PULL), bound once; its address
  goes back to the orchestrator with each accepted request, and stops for this
  instance's requests arrive there; a frame that is not a stop is dropped and counted
  (``StopInbox.dropped``, :mod:`triton_disagg.readers`).

Invariants of the sockets: only the decode-loop thread sends or receives on these
sockets; nothing here blocks. A send that would wait (the orchestrator is gone or not reading, and
``HIGH_WATER_MARK`` messages already wait for it) or fails closes that address's socket,
which drops every message still queued on it, and so does a disconnection (the
orchestrator closed its socket or died, or stopped answering heartbeats; what was on the
way may be lost), seen by each socket's monitor at the next flush; either way
:meth:`TokenOutbox.flush` reports the address, with this flush's events for it unsent:
the loop then fails every request that streams to it, never only those of the failed
message. At most ``MAX_SOCKETS`` sockets stay open after a flush: beyond that the
least recently used ones whose address no live request names are closed (given
``EVICT_LINGER_MS`` to deliver what they hold), as is a socket whose address had nothing
to send for ``IDLE_SECONDS`` (an orchestrator restarts with a new address), so dead
addresses do not pile up; the loop admits requests for at most ``MAX_SOCKETS`` distinct
addresses at a time.
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from typing import Any, Collection
# Any here: decoded msgpack values, checked field by field.

import msgpack
import zmq

from triton_disagg.engine.logprobs import MAX_LOGPROBS, TopLogprobs
from triton_disagg.engine.sequence import TokenEvent
from triton_disagg.errors import ErrorCode
from triton_disagg.protocol import FINISH_REASONS
from triton_disagg.readers import MALFORMED, DroppedFrames
from triton_disagg.zmq_endpoints import Endpoint, bind, push_socket

VERSION = 3
KEY_SEPARATOR = "#"
MAX_KEY_CHARS = 64                  # a key is 22 (token_urlsafe(16)); longer is not one
MAX_TOKEN_FRAME_BYTES = 64 << 20    # a token message: one step's events for one address
MAX_STOP_FRAME_BYTES = 64 << 10     # a stop: a request id and its key
HIGH_WATER_MARK = 1000       # messages (decode steps) queued per orchestrator address
IDLE_SECONDS = 60.0          # a socket with nothing to send this long is closed
MAX_SOCKETS = 64             # open token sockets after a flush (distinct addresses)
EVICT_LINGER_MS = 1000       # what an evicted socket still holds gets this long to leave
STOP_READER = "generation stop inbox"     # the reader label of its dropped frames
_log = logging.getLogger(__name__)


class WireError(ValueError):
    """A frame that is not a message of this schema version."""


_ALWAYS = ("request_id", "key", "seq", "tokens")     # an event's fields on the wire
_UNLESS_DEFAULT = (("log_probs", None), ("finish_reason", None), ("error", None),
                   ("code", ErrorCode.INTERNAL), ("top", None))   # (field, its default)
_OPTIONAL = (("log_probs", list), ("finish_reason", str), ("error", str))   # (field, type)


def encode_events(events: list[TokenEvent]) -> bytes:
    return msgpack.packb({"v": VERSION, "events": [_packed(e) for e in events]},
                         default=_top_fields)


def decode_events(frame: bytes) -> list[TokenEvent]:
    events = _message(frame, "events")["events"]
    if not isinstance(events, list):
        raise WireError("token message: 'events' must be a list")
    return [_event(e) for e in events]


def encode_stop(request_id: str, key: str) -> bytes:
    return msgpack.packb({"v": VERSION, "stop": request_id, "key": key})


def decode_stop(frame: bytes) -> tuple[str, str]:
    """``(request id, key)`` of a stop."""
    message = _message(frame, "stop")
    request_id, key = message["stop"], message.get("key")
    if not isinstance(request_id, str) or not _is_key(key):
        raise WireError("stop message: 'stop' must be a string and 'key' an ASCII string")
    return request_id, key


def same_key(given: str, expected: str) -> bool:
    """Whether ``given`` is ``expected``, in constant time; never raises for a string
    (``hmac.compare_digest`` raises on non-ASCII ``str``: compare their UTF-8 bytes)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                               expected.encode("utf-8", "surrogatepass"))


def with_key(address: str, key: str) -> str:
    """The token address a request names: where its events go, and its key."""
    return f"{address}{KEY_SEPARATOR}{key}"


def split_key(token_address: str) -> tuple[str, str]:
    """``(address, key)`` of a token address made by :func:`with_key`; WireError without a
    key."""
    address, separator, key = token_address.rpartition(KEY_SEPARATOR)
    if not separator or not address or not key:
        raise WireError(f"token address {token_address!r} carries no request key "
                        f"('<address>{KEY_SEPARATOR}<key>')")
    return address, key


def _packed(event: TokenEvent) -> dict[str, Any]:
    """``event`` as it goes on the wire: its fields by name, those at their default left out."""
    out = {name: getattr(event, name) for name in _ALWAYS}
    for name, default in _UNLESS_DEFAULT:
        value = getattr(event, name)
        if value != default:
            out[name] = value
    return out


def _top_fields(value: Any) -> list:
    """msgpack's ``default``: a :class:`TopLogprobs` as its fields, in order."""
    if isinstance(value, TopLogprobs):
        return [value.ids, value.logprobs]
    raise TypeError(f"cannot put a {type(value).__name__} on the token wire")


def _message(frame: bytes, key: str) -> Any:
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for garbage
        raise WireError(f"not a msgpack message ({type(exc).__name__})") from None
    if not isinstance(message, dict):
        raise WireError("not a message: expected a msgpack map")
    if message.get("v") != VERSION:
        raise WireError(f"message version {message.get('v')!r}; this side speaks {VERSION}")
    if key not in message:
        raise WireError(f"message without {key!r}")
    return message


def _event(raw: Any) -> TokenEvent:
    if not isinstance(raw, dict) or not isinstance(raw.get("request_id"), str):
        raise WireError("token event: expected a map with a request id under 'request_id'")
    if not _is_key(raw.get("key")) or type(raw.get("seq")) is not int:
        raise WireError("token event: expected the request's key (ASCII) under 'key' and "
                        "its sequence number under 'seq'")
    tokens = raw.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise WireError("token event: 'tokens' must be a list of integers")
    fields: dict[str, Any] = {}
    for name, kind in _OPTIONAL:
        if name in raw:
            if not isinstance(raw[name], kind):
                raise WireError(f"token event: {name!r} must be a {kind.__name__}")
            fields[name] = raw[name]
    if "log_probs" in fields:
        fields["log_probs"] = _log_probs(fields["log_probs"], len(tokens))
    if "top" in raw:
        fields["top"] = _top(raw["top"], len(tokens))
    if fields.get("finish_reason") not in (None, *FINISH_REASONS):
        raise WireError(f"token event: 'finish_reason' must be one of "
                        f"{', '.join(FINISH_REASONS)}")
    if "error" in fields:
        fields["code"] = _code(raw.get("code", ErrorCode.INTERNAL.value))
    return TokenEvent(raw["request_id"], tokens, seq=raw["seq"], key=raw["key"], **fields)


def _log_probs(raw: list, n: int) -> list[float]:
    """An event's ``log_probs``: one number per token of its ``n`` (an integer read as a
    float), none NaN or +inf (a log-probability is at most 0; -inf is one)."""
    if len(raw) != n or not all(type(v) in (int, float) for v in raw):
        raise WireError(f"token event: 'log_probs' must be a list of {n} numbers, one per token")
    values = [float(v) for v in raw]
    if any(math.isnan(v) or v == math.inf for v in values):
        raise WireError("token event: 'log_probs' holds NaN or +inf")
    return values


def _top(raw: Any, n: int) -> list[TopLogprobs]:
    """An event's ``top``: one ``[ids, log-probs]`` pair per token of its ``n``, each of the
    same ``k <= MAX_LOGPROBS`` entries."""
    def pair(entry: Any) -> TopLogprobs | None:
        if not isinstance(entry, list) or len(entry) != 2:
            return None
        ids, lps = entry
        if (not isinstance(ids, list) or not isinstance(lps, list) or len(ids) != len(lps)
                or len(ids) > MAX_LOGPROBS or not all(type(i) is int for i in ids)
                or not all(type(v) in (int, float) for v in lps)):
            return None
        return TopLogprobs(ids, [float(v) for v in lps])

    rows = [pair(entry) for entry in raw] if isinstance(raw, list) and len(raw) == n else [None]
    if None in rows or len({len(r.ids) for r in rows}) > 1:
        raise WireError(f"token event: 'top' must hold one [ids, log-probs] pair per token, "
                        f"each of the same length, at most {MAX_LOGPROBS}")
    return rows


def _code(name: Any) -> ErrorCode:
    if not isinstance(name, str):
        raise WireError("token event: 'code' must be a string")
    return ErrorCode.__members__.get(name, ErrorCode.INTERNAL)


def _is_key(key: Any) -> bool:
    return isinstance(key, str) and key.isascii() and len(key) <= MAX_KEY_CHARS



class TokenOutbox:
    def __init__(self, context: zmq.Context, max_sockets: int = MAX_SOCKETS):
        self.context, self.max_sockets = context, max_sockets
        self.sockets: dict[str, zmq.Socket] = {}      # least recently used first
        self.monitors: dict[str, zmq.Socket] = {}     # each socket's disconnection events
        self.last_sent: dict[str, float] = {}
        self.pending: dict[str, list[TokenEvent]] = {}
        self.swept = time.monotonic()

    def put(self, address: str, event: TokenEvent) -> None:
        self.pending.setdefault(address, []).append(event)

    def flush(self, keep: Collection[str] = ()) -> dict[str, list[TokenEvent]]:
        """Send what was put since the last flush. Returns the addresses whose socket was
        dropped, each with the events of its failed message that were not errors; sockets
        beyond ``max_sockets`` whose address is not in ``keep`` are closed."""
        pending, self.pending = self.pending, {}
        dropped: dict[str, list[TokenEvent]] = {}
        now = time.monotonic()
        for address in [a for a, monitor in self.monitors.items() if _disconnected(monitor)]:
            _log.warning("generation: the orchestrator at %s disconnected; its socket is "
                         "closed and every request streaming to it fails", address)
            dropped[address] = [e for e in pending.pop(address, []) if e.error is None]
            self._drop(address)
        for address, events in pending.items():
            try:
                sock = self.sockets.pop(address, None) or self._connect(address)
                self.sockets[address] = sock                  # now the most recently used
                sock.send(encode_events(events), zmq.NOBLOCK)
                self.last_sent[address] = now
            except Exception as exc:  # noqa: BLE001 - zmq.Again: HIGH_WATER_MARK messages wait
                _log.warning("generation: cannot send tokens to %s (%s); its socket is closed "
                             "and every request streaming to it fails", address, exc)
                dropped[address] = [e for e in events if e.error is None]
                self._drop(address)
        if now - self.swept >= IDLE_SECONDS:
            self.swept = now
            for address in [a for a, t in self.last_sent.items() if now - t >= IDLE_SECONDS]:
                self._drop(address)
        for address in [a for a in self.sockets if a not in keep
                        ][:max(0, len(self.sockets) - self.max_sockets)]:
            self._drop(address, EVICT_LINGER_MS)
        return dropped

    def _connect(self, address: str) -> zmq.Socket:
        sock = push_socket(self.context, address, HIGH_WATER_MARK)
        self.monitors[address] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        return sock

    def _drop(self, address: str, linger_ms: int = 0) -> None:
        sock = self.sockets.pop(address, None)
        self.last_sent.pop(address, None)
        monitor = self.monitors.pop(address, None)
        if monitor is not None:
            monitor.close(linger=0)
        if sock is not None:
            sock.close(linger=linger_ms)

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket; what is still unsent after ``linger_ms`` is dropped."""
        for address in list(self.sockets):
            self._drop(address, linger_ms)
        self.last_sent.clear()


def _disconnected(monitor: zmq.Socket) -> bool:
    """Whether ``monitor`` reported a disconnection since it was last asked."""
    seen = False
    while True:
        try:
            monitor.recv_multipart(zmq.NOBLOCK)    # [event id + value, endpoint]
        except zmq.Again:
            return seen
        seen = True


def send_errors(context: zmq.Context, events: list[tuple[str, TokenEvent]]) -> None:
    """Send ``(address, error event)`` pairs over sockets of the caller's own (for a thread
    other than the loop's), given a second to leave."""
    outbox = TokenOutbox(context)
    for address, event in events:
        outbox.put(address, event)
    outbox.flush()
    outbox.close(linger_ms=1000)


class StopInbox:
    """``host`` None: ipc in a private directory (orchestrators on this host); else tcp,
    advertised on ``host`` and bound on ``bind_host`` (default: ``host``'s address)."""

    def __init__(self, context: zmq.Context, host: str | None, bind_host: str | None = None):
        self.sock = context.socket(zmq.PULL, socket_class=zmq.Socket)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_STOP_FRAME_BYTES)
        self.endpoint: Endpoint = bind(self.sock, host, "control", bind_host)
        self.dropped = DroppedFrames(STOP_READER)

    @property
    def address(self) -> str:
        return self.endpoint.address

    def take(self) -> list[tuple[str, str]]:
        """``(request id, key)`` of every stop that arrived (a key is an ASCII string;
        malformed frames are dropped and counted)."""
        stops = []
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return stops
            try:
                stops.append(decode_stop(frame))
            except WireError as exc:
                self.dropped.drop(MALFORMED, f"a control frame: {exc}")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.endpoint.release()

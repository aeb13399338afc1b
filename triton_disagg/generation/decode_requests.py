"""The decode loop's per-request state, and the token events it becomes.

Invariants: ``StreamState.tokens`` / ``StreamState.log_probs`` (and ``StreamState.top``, when the request asked
for alternatives) hold exactly the tokens made since the request's last event (plain ints
and floats, ready for msgpack); ``StreamState.seq`` is the
number of events made for the request so far, so its events carry 0, 1, 2, ... and
every one carries the request's key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from triton_disagg.engine.logprobs import TopLogprobs
from triton_disagg.errors import ErrorCode
from triton_disagg.token_wire import StreamEvent


@dataclass
class StreamState:
    """One request's token stream to the orchestrator: where it goes and what is pending."""

    address: str                    # the orchestrator's token address (without the key)
    key: str                        # the request's key (token_wire)
    streaming: bool
    with_log_probs: bool = True
    emitted: bool = False           # has the first token gone out
    seq: int = 0                    # events made for it so far
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top: list[TopLogprobs] = field(default_factory=list)
    cum_log_prob: float = 0.0

    def numbered(self) -> int:
        """The next event's sequence number (counted as made)."""
        self.seq += 1
        return self.seq - 1


def token_event(request_id: str, live: StreamState, reason: str | None) -> StreamEvent:
    """The tokens ``live`` holds (log probs only when asked for, alternatives when made),
    final with ``reason``."""
    seq = live.numbered()
    if not live.with_log_probs:
        return StreamEvent(request_id, live.tokens, finish_reason=reason, seq=seq, key=live.key)
    return StreamEvent(request_id, live.tokens, live.log_probs, live.cum_log_prob, reason,
                       seq=seq, key=live.key, top=live.top or None)


def error_event(request_id: str, live: StreamState, message: str,
                code: ErrorCode = ErrorCode.INTERNAL) -> StreamEvent:
    """The final event of a request that failed with ``code``, saying why in ``message``."""
    return StreamEvent(request_id, [], error=message, code=code, seq=live.numbered(),
                       key=live.key)

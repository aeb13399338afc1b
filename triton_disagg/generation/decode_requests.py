"""The decode loop's per-request state, and the token event it becomes.

Invariant: ``Live.tokens`` / ``Live.log_probs`` hold exactly the tokens made since the
request's last event (plain ints and floats, ready for msgpack).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from triton_disagg.token_wire import StreamEvent


@dataclass
class Live:
    address: str                    # the orchestrator's token address
    streaming: bool
    with_log_probs: bool = True
    emitted: bool = False           # has the first token gone out
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    cum_log_prob: float = 0.0


def token_event(request_id: str, live: Live, reason: str | None) -> StreamEvent:
    """The tokens ``live`` holds (log probs only when asked for), final with ``reason``."""
    if not live.with_log_probs:
        return StreamEvent(request_id, live.tokens, finish_reason=reason)
    return StreamEvent(request_id, live.tokens, live.log_probs, live.cum_log_prob, reason)

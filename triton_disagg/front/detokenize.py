"""Token ids -> text deltas, stateless per response and correct for multi-byte characters.

The orchestrator sends each response's ids as a window ``ids`` whose first
``offset`` ids were already covered by earlier responses. The text a response
adds is ``visible(ids) - visible(ids[:offset])``, where ``visible`` decodes and,
unless the response is the final one, drops a trailing incomplete character
(U+FFFD from a split UTF-8 sequence), which then comes out with a later response.

Invariant: for windows produced by :class:`DeltaWindows` the concatenated
deltas equal ``decode(all ids)``. Decoding a window that starts mid-sequence
yields the same garbage prefix in both terms, so it cancels. The window keeps
:data:`WINDOW` earlier ids: a garbage head (at most 3 orphan bytes) plus an
incomplete tail (at most 3 bytes) leave at least one whole character between
them, so trimming the tail never eats into the head.
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"
WINDOW = 8


def text_delta(decode: Callable[[Sequence[int]], str], ids: Sequence[int], offset: int,
               is_final: bool) -> str:
    ids = list(ids)
    old = _visible(decode(ids[:offset]), trim=True) if offset else ""
    new = _visible(decode(ids), trim=not is_final)
    if new.startswith(old):
        return new[len(old):]
    # Tokenizers whose decode is not prefix-stable (rare): fall back to the longest common prefix.
    common = 0
    for a, b in zip(old, new):
        if a != b:
            break
        common += 1
    return new[common:]


def _visible(text: str, trim: bool) -> str:
    return text.rstrip(REPLACEMENT) if trim else text


class DeltaWindows:
    """Cuts a growing id sequence into (window, offset) pairs for :func:`text_delta`."""

    def __init__(self, prefix: Sequence[int] = ()):
        self.ids: list[int] = list(prefix)
        self.sent = 0              # ids covered by earlier windows

    def next(self, new_ids: Sequence[int]) -> tuple[list[int], int]:
        self.ids.extend(new_ids)
        start = max(0, self.sent - WINDOW)
        window, offset = self.ids[start:], self.sent - start
        self.sent = len(self.ids)
        return window, offset

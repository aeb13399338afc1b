"""A stand-in for an :class:`~triton_disagg.engine.spec.EngineSpec` holding only the limits
that requests are checked against (``max_seq_len``, ``max_context``, ``shape.vocab_size``)."""

from __future__ import annotations

from types import SimpleNamespace


def limits_spec(max_seq_len: int = 64, vocab_size: int = 100) -> SimpleNamespace:
    return SimpleNamespace(max_seq_len=max_seq_len, max_context=max_seq_len,
                           shape=SimpleNamespace(vocab_size=vocab_size))

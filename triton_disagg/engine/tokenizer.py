"""The engine directory's tokenizer (``tokenizer.json``, via the ``tokenizers`` library).

A prompt's ids are Hugging Face's ``tokenizer(prompt).input_ids`` (what vLLM sends the model,
so ``prompt_tokens`` counts agree): with the special tokens, such as a BOS, that
``tokenizer.json``'s post-processor adds (``add_special_tokens=True``). transformers 5 loads
that post-processor as it is for a ``tokenizer.json`` that has one, whatever
``tokenizer_config.json``'s ``add_bos_token``/``add_eos_token`` say
(tests/unit/test_prompt_tokens_vs_hf.py checks it against transformers). Text that holds its
special tokens already (a chat template's output) is encoded with
``add_special_tokens=False``, as vLLM does; stop/bad words never get them. Decoding skips
special tokens by default.

Streamed text (:func:`text_delta`, :class:`DeltaWindows`): token ids -> text deltas,
stateless per response and correct for multi-byte characters. The orchestrator sends each
response's ids as a window ``ids`` whose first ``offset`` ids were already covered by
earlier responses. The text a response adds is ``visible(ids) - visible(ids[:offset])``,
where ``visible`` decodes and, unless the response is the final one, drops a trailing
incomplete character (U+FFFD from a split UTF-8 sequence), which then comes out with a
later response.

Invariant: for windows produced by :class:`DeltaWindows` the concatenated deltas equal
``decode(all ids)``. Decoding a window that starts mid-sequence yields the same garbage
prefix in both terms, so it cancels. The window keeps :data:`WINDOW` earlier ids: a garbage
head (at most 3 orphan bytes) plus an incomplete tail (at most 3 bytes) leave at least one
whole character between them, so trimming the tail never eats into the head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

from triton_disagg.engine.spec import TOKENIZER_FILE, EngineFormatError
from triton_disagg.engine.token_bound import max_token_bytes


class Tokenizer:
    def __init__(self, engine_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(engine_dir) / TOKENIZER_FILE
        if not path.is_file():
            raise EngineFormatError(f"{path}: not found; rebuild the engine from a checkpoint "
                                    f"that has a tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises bare Exception
            raise EngineFormatError(f"{path}: not a valid tokenizer.json ({exc})") from exc
        self.max_token_bytes = max_token_bytes(json.loads(path.read_text(encoding="utf-8")))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Prompt text to token ids, with the special tokens the tokenizer adds (module
        docstring) unless ``add_special_tokens`` is False. Encoded as a batch of one: the
        library's ``encode_batch`` lets go of the GIL while it works and ``encode`` does not
        (a 1 M character prompt held it ~0.6 s), so a prompt tokenized on a worker thread
        does not stall the front's event loop."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_word(self, text: str) -> list[int]:
        """A stop or bad word to token ids, never with special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def surely_more_tokens(self, text: str, n: int) -> bool:
        """True only if ``text`` encodes to more than ``n`` tokens, decided from its length in
        O(len) without encoding it (see :mod:`triton_disagg.engine.token_bound`); False means
        "encode to know"."""
        if self.max_token_bytes is None:
            return False
        if self._tok.normalizer is not None:
            text = self._tok.normalizer.normalize_str(text)
        return len(text.encode("utf-8")) > n * self.max_token_bytes

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


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

"""The engine directory's tokenizer (``tokenizer.json``, via the ``tokenizers`` library).

Special tokens (such as a BOS the tokenizer's post-processor would prepend) are added
to prompts only when ``add_special_tokens`` is configured, never to stop/bad words.
Decoding skips special tokens by default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from triton_disagg.engine.spec import TOKENIZER_FILE, EngineFormatError
from triton_disagg.engine.token_bound import max_token_bytes


class Tokenizer:
    def __init__(self, engine_dir: str | Path, add_special_tokens: bool = False):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(engine_dir) / TOKENIZER_FILE
        if not path.is_file():
            raise EngineFormatError(f"{path}: not found; rebuild the engine from a checkpoint "
                                    f"that has a tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises bare Exception
            raise EngineFormatError(f"{path}: not a valid tokenizer.json ({exc})") from exc
        self.add_special_tokens = add_special_tokens
        self.max_token_bytes = max_token_bytes(json.loads(path.read_text(encoding="utf-8")))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Prompt text to token ids (specials only if configured)."""
        return self._tok.encode(text, add_special_tokens=self.add_special_tokens).ids

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

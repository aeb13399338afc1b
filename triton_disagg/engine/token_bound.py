"""A lower bound on a text's token count, read from its length, so that a text far too long
for the engine is refused without being tokenized.

If every token stands for at most ``L`` bytes of the text the model sees, a text of ``b``
bytes encodes to at least ``b / L`` tokens; ``b > n * L`` therefore proves "more than ``n``
tokens" without encoding. :func:`max_token_bytes` returns such an ``L`` only for
tokenizers where the premise holds, and ``None`` (no bound: encode to know) otherwise:

- the model is BPE and never emits an unknown token (``unk_token`` unset, or
  ``byte_fallback`` on): an unknown token may stand for any run of text;
- the pre-tokenizer drops nothing (ByteLevel, Metaspace, Digits, Split without
  ``Removed``, or a Sequence of these): a whitespace splitter drops unbounded text;
- the normalizer only maps characters (NFC/NFD/NFKC/NFKD, Lowercase, Prepend, Replace, or a
  Sequence of these) and leaves added tokens' content ("<|eot|>") as it is; the bound is
  then applied to the normalized text (a Strip normalizer could drop unbounded whitespace
  around a special token);
- no added token strips spaces next to it (``lstrip``/``rstrip``).

``L`` is the longest vocabulary entry, added tokens included, in UTF-8 bytes. An entry is
never shorter than the text it matches: byte-level BPE spells each byte as one character
of 1-2 bytes, Metaspace spells a space as "▁" in both, a byte-fallback token "<0x41>"
stands for one byte, and an added token is its own content.
"""

from __future__ import annotations

from typing import Any
# Any here: values of a tokenizer's JSON config.

_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split"}
_CHAR_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace"}


def _flatten(node: dict | None, children: str) -> list[dict]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [leaf for child in node.get(children, []) for leaf in _flatten(child, children)]
    return [node]


def max_token_bytes(config: dict[str, Any]) -> int | None:
    """``L`` for a parsed ``tokenizer.json`` (see the module docstring), or None."""
    model = config.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") is not None
                                      and not model.get("byte_fallback")):
        return None
    for pre in _flatten(config.get("pre_tokenizer"), "pretokenizers"):
        if pre.get("type") not in _KEEPING_PRE_TOKENIZERS or pre.get("behavior") == "Removed":
            return None
    if any(n.get("type") not in _CHAR_NORMALIZERS
           for n in _flatten(config.get("normalizer"), "normalizers")):
        return None
    added = config.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    entries = list(model.get("vocab") or {}) + [t["content"] for t in added]
    return max((len(entry.encode("utf-8")) for entry in entries), default=None)

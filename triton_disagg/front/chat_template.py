"""The checkpoint's chat template (``chat_template`` of ``tokenizer_config.json``, copied into
the engine directory by the builder), rendered as transformers' ``apply_chat_template`` does.

Invariants: the template runs in jinja2's immutable sandbox with the environment options,
globals and filters transformers gives it (``trim_blocks``, ``lstrip_blocks``, the
``loopcontrols`` extension, ``raise_exception``, ``strftime_now``, ``tojson`` that keeps
non-ASCII), with the tokenizer config's special-token strings (``bos_token``, ...) as
variables, so the text equals ``tokenizer.apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)``; a template that raises (``raise_exception``, a sandbox
violation) is the request's mistake (:class:`RequestError`); an engine without a template
has none (``ChatTemplate.load`` returns None) and chat requests are refused by name.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any
# Any here: the JSON values a chat template serializes.

from triton_disagg.errors import RequestError

TOKENIZER_CONFIG = "tokenizer_config.json"
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                   "cls_token", "mask_token")


def special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """A tokenizer config's special tokens (``bos_token``, ...) that it names, as text."""
    tokens = {}
    for name in _SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):   # AddedToken serialised: {"content": ...}
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


class ChatTemplate:
    def __init__(self, template: str, special_tokens: dict[str, str]):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise RequestError(f"chat template: {message}")

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators=None, sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(template)
        self.source, self.special_tokens = template, special_tokens

    @classmethod
    def load(cls, engine_dir: str | Path) -> "ChatTemplate | None":
        """The engine's template, or None when its tokenizer config has none."""
        path = Path(engine_dir) / TOKENIZER_CONFIG
        if not path.is_file():
            return None
        config = json.loads(path.read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if isinstance(template, list):    # transformers' named templates: take "default"
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        if not isinstance(template, str):
            return None
        return cls(template, special_tokens(config))

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (each ``{"role", "content"}``, content a string)."""
        from jinja2.exceptions import SecurityError, TemplateError

        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except SecurityError as exc:
            raise RequestError(f"chat template refused: {exc}") from None
        except TemplateError as exc:
            raise RequestError(f"chat template failed on these messages: {exc}") from None

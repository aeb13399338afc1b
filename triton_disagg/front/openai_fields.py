"""The building blocks of the HTTP front's request models (:mod:`.openai_models`): the
engine's bounds on a request (:class:`EngineLimits`), JSON as sent (:class:`StrictModel`),
the field types bounded by the engine (``*_field``, :func:`token_ids`), a chat's messages,
and the checks they share.

Invariants: a body validates only as a JSON object whose every field is known (else
``extra_forbidden``), of its JSON type (strict: no ``"5"`` for 5, no ``true`` for 1, no NaN)
and in its range; a field sent as ``null`` is as if not sent. Every number is bounded before
it is used and every list before its items are looked at (pydantic checks a list's length
first): ``max_tokens`` and ``min_tokens`` by the engine's ``max_seq_len`` less one prompt
token, ``top_k`` and token ids by its vocabulary; ``messages`` at most ``max_seq_len``
messages of at most ``MAX_TEXT_PARTS`` text parts each and ``MAX_TEXT_PARTS_TOTAL`` in all
(counted on the raw JSON before any message is looked at), a token-id prompt at most
``max_seq_len`` ids, at most ``MAX_CHOICES`` prompts. A list as long as the engine allows,
or of content parts, stops at its first bad item (:func:`bounded_list`), so a refused body
has a few errors, never one per item.
"""

import reprlib
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator,
                      Field, Tag, WithJsonSchema, model_validator)
from pydantic_core import PydanticCustomError, PydanticKnownError

MAX_CHOICES = 8                 # prompts x n of one request: each is one engine request
MAX_TEXT_PARTS = 256            # a chat message's content parts
MAX_TEXT_PARTS_TOTAL = 1024     # content parts of all of a chat's messages
SHOWN_CHARS = 60                # of a value quoted in an error message
INT32_MAX = 2**31 - 1
_SHOW = reprlib.Repr()         # Python 3.11's takes no arguments
_SHOW.maxlevel, _SHOW.maxstring = 2, SHOWN_CHARS
_SHOW.maxother = _SHOW.maxlong = SHOWN_CHARS
# The names of union branches (pydantic puts them in an error's ``loc``); none is a field's.
BRANCHES = frozenset({"one text", "token ids", "several prompts", "one stop", "stop words",
                      "text parts"})


@dataclass(frozen=True)
class EngineLimits:
    """The engine's bounds on a request
    (:class:`~triton_disagg.front.orchestrator_call.RequestEncoder` has the served engine's);
    the defaults are those of the tensors' INT32."""

    max_seq_len: int = INT32_MAX
    vocab_size: int = INT32_MAX


def shown(value: Any) -> str:
    """``value``'s repr, never more than ``SHOWN_CHARS`` characters, built without
    rendering all of a large or deep value."""
    text = _SHOW.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def refused(param: str, message: str) -> PydanticCustomError:
    """A rule between fields broken, ``param`` the field at fault."""
    return PydanticCustomError("refused", message, {"param": param})


def only_default(fine: tuple, why: str) -> Any:
    """A field OpenAI defines that this server honours only at one of the values ``fine``
    (same value and JSON type; the first is the documented one), or absent, else refused
    with ``why``."""
    def check(value: Any) -> Any:
        if not any(value == f and type(value) is type(f) for f in fine):
            raise PydanticCustomError("not_supported", f"{shown(value)}: {why}")
        return value
    return Annotated[Any, AfterValidator(check),
                     WithJsonSchema({"enum": [*fine[:1], None], "description": why})]


def by_form(forms: dict[type, str], message: str) -> Discriminator:
    """A union's branch chosen by the JSON type of the value (``forms``: Python type ->
    branch tag); any other type fails with ``message``."""
    return Discriminator(lambda v: next((tag for t, tag in forms.items() if isinstance(v, t)),
                                        None),
                         custom_error_type="wrong_type", custom_error_message=message)


def bounded_list(item: Any, max_length: int, *then: BeforeValidator,
                 min_length: int = 0) -> Any:
    """A list of ``min_length`` to ``max_length`` ``item``s: its length checked before
    anything else (pydantic's own check comes after the first item with ``fail_fast``), then
    the validators ``then`` on the raw list, then its items up to the first bad one (its
    only error: a refused list costs one error, not one per item)."""
    def length_fits(value: Any) -> Any:
        if isinstance(value, list) and len(value) > max_length:
            raise PydanticKnownError("too_long", {"field_type": "List", "max_length": max_length,
                                                  "actual_length": len(value)})
        return value
    # the last of Annotated's validators runs first
    return Annotated[list[item], Field(min_length=min_length, max_length=max_length,
                                       fail_fast=True), *reversed(then),
                     BeforeValidator(length_fits)]


# ---- the fields whose bounds are the engine's (each a function of its limits) ---------------

def max_tokens_field(limits: EngineLimits) -> Any:
    return Annotated[int | None, Field(ge=1, le=limits.max_seq_len - 1, description=(
        f"tokens to generate, at most this engine's max_seq_len {limits.max_seq_len} "
        f"less a prompt token"))]


def min_tokens_field(limits: EngineLimits) -> Any:
    return Annotated[int | None, Field(ge=0, le=limits.max_seq_len - 1, description=(
        f"vLLM's: tokens generated before an end token counts, at most this engine's "
        f"max_seq_len {limits.max_seq_len} less one"))]


def top_k_field(limits: EngineLimits) -> Any:
    return Annotated[int | None, Field(ge=-1, le=limits.vocab_size, description=(
        "vLLM's: sample among the k likeliest tokens; -1 or 0: off"))]


def token_ids(limits: EngineLimits, min_length: int = 1) -> Any:
    """A prompt of token ids: ``min_length`` to ``max_seq_len`` of them (counted before they
    are looked at), each in the vocabulary."""
    last = limits.vocab_size - 1

    def in_vocabulary(ids: list[int]) -> list[int]:
        bad = next((i for i in ids if not 0 <= i <= last), None)
        if bad is not None:
            raise PydanticCustomError("not_in_vocabulary", f"token id {shown(bad)} is not in "
                                      f"this model's vocabulary (0 to {last})")
        return ids
    return Annotated[bounded_list(int, limits.max_seq_len, min_length=min_length),
                     AfterValidator(in_vocabulary),
                     WithJsonSchema({"type": "array", "minItems": min_length,
                                     "maxItems": limits.max_seq_len,
                                     "items": {"type": "integer", "minimum": 0,
                                               "maximum": last}})]


def prompt_field(limits: EngineLimits) -> Any:
    """OpenAI's four forms: a string, token ids, or a list of at most ``MAX_CHOICES`` of
    either."""
    one_form = by_form({str: "one text", list: "token ids"},
                        "expected a string or a list of token ids")
    one = Annotated[Annotated[str, Tag("one text")] | Annotated[token_ids(limits),
                                                                  Tag("token ids")], one_form]

    def form(value: Any) -> str | None:
        if isinstance(value, str):
            return "one text"
        if isinstance(value, list):
            return "several prompts" if value and isinstance(value[0], (str, list)) \
                else "token ids"
        return None
    several = Annotated[list[one], Field(min_length=1, max_length=MAX_CHOICES)]
    return Annotated[Annotated[str, Tag("one text")]
                     | Annotated[token_ids(limits), Tag("token ids")]
                     | Annotated[several, Tag("several prompts")],
                     Discriminator(form, custom_error_type="wrong_type",
                                   custom_error_message="expected a string, a list of token "
                                   "ids, or a list of either"),
                     Field(description=f"at most {MAX_CHOICES} prompts, each text or at most "
                                       f"this engine's max_seq_len {limits.max_seq_len} ids")]


class StrictModel(BaseModel):
    """JSON as sent: known fields only, each of its JSON type; ``null`` is not sent (a field
    whose value is ``null``, known or not, counts as absent: what the schema says too)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True,
                              json_schema_extra={"additionalProperties": {"type": "null"}})

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """``data`` less its ``null`` fields and all its unknown fields but the first (one
        ``extra_forbidden`` error, not one per unknown field of a hostile body)."""
        if not isinstance(data, dict):
            return data
        unknown = next((k for k, v in data.items() if k not in cls.model_fields
                        and v is not None), None)
        return {k: v for k, v in data.items()
                if v is not None and (k in cls.model_fields or k == unknown)}


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class Message(StrictModel):
    """A chat message of text: a string, or at most ``MAX_TEXT_PARTS`` text parts that are
    joined."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[Annotated[str, Tag("one text")]
                       | Annotated[bounded_list(TextPart, MAX_TEXT_PARTS), Tag("text parts")],
                       by_form({str: "one text", list: "text parts"},
                                "expected a string or a list of text parts")]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content)


def _parts_fit(messages: Any) -> Any:
    """The raw ``messages`` list, if its messages have at most ``MAX_TEXT_PARTS_TOTAL``
    content parts in all (counted without looking at a part, a message's at most
    ``MAX_TEXT_PARTS``: one with more is refused by its own length check; anything else is
    left for the model's checks)."""
    if isinstance(messages, list):
        parts = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            parts += min(len(content), MAX_TEXT_PARTS) if isinstance(content, list) else 0
            if parts > MAX_TEXT_PARTS_TOTAL:
                raise refused("messages", f"more than {MAX_TEXT_PARTS_TOTAL} content parts "
                                          f"in all messages")
    return messages


def messages_field(limits: EngineLimits) -> Any:
    # the messages counted, then their parts, then each message looked at
    return Annotated[bounded_list(Message, limits.max_seq_len, BeforeValidator(_parts_fit),
                                  min_length=1),
                     Field(description=f"at most this engine's max_seq_len "
                                       f"{limits.max_seq_len} messages of at most "
                                       f"{MAX_TEXT_PARTS} content parts, "
                                       f"{MAX_TEXT_PARTS_TOTAL} in all")]

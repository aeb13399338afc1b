"""The checks the HTTP front's request fields share (:mod:`.openai_models`,
:mod:`.tokenizer_routes`), as pydantic field types and errors.

Invariants: a list is counted before its items are looked at, and stops at its first bad
item (:func:`bounded_list`): a refused list costs one error, never one per item; a value
quoted in an error message is at most ``SHOWN_CHARS`` characters however large or deep it
is (:func:`shown`); a field this server honours only at its default is refused, with why,
at any other value (:func:`only_default`); a union of JSON forms is chosen by the value's
JSON type, any other type one ``wrong_type`` error (:func:`by_form`); a rule between fields
fails as a ``refused`` error whose ``ctx["param"]`` names the field (:func:`refused`).
"""

import reprlib
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, WithJsonSchema
from pydantic_core import PydanticCustomError, PydanticKnownError

SHOWN_CHARS = 60                # of a value quoted in an error message
_SHOW = reprlib.Repr()         # Python 3.11's takes no arguments
_SHOW.maxlevel, _SHOW.maxstring = 2, SHOWN_CHARS
_SHOW.maxother = _SHOW.maxlong = SHOWN_CHARS


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

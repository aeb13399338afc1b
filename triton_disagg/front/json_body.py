"""A request's JSON body, read and parsed within bounds: at most ``MAX_BODY_BYTES`` (aiohttp's
``client_max_size``: 413), arriving within ``body_timeout_seconds`` (else 408), framed and
not compressed (a ``Content-Encoding`` is a 415, refused unread: the front's runner leaves
bodies as sent, ``auto_decompress`` off, so no gzip bomb is inflated), UTF-8, and JSON
that Python's parser takes (else 400 naming the
problem: not JSON, nested deeper than the parser's recursion limit, an integer of more than
``sys.get_int_max_str_digits()`` digits, a string with a lone surrogate: a ``\\uD800``-
``\\uDFFF`` escape not paired into one character, which JSON's grammar allows and UTF-8
cannot encode, so no string of a parsed body fails to encode later). The value is then
checked by the caller's ``check`` (a request model's validation). A body over
``OFF_LOOP_BYTES`` is decoded and checked on ``PARSER``, one thread, so a large body neither
stalls the event loop's other clients (streams, ``/healthz``) nor has more than one parse's
worth of objects alive at a time.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar
# Any here: decoded JSON values, checked by whoever reads them.

from aiohttp import web

from triton_disagg.front.openai_api import ApiError

MAX_BODY_BYTES = 10 * 2**20     # a larger body is refused with 413
OFF_LOOP_BYTES = 64 * 2**10     # a larger body is parsed on PARSER, not the event loop
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")   # \uD800-\uDFFF, either case
PARSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="json-body")
Checked = TypeVar("Checked")


def decode(raw: bytes) -> Any:
    """``raw`` as a JSON value, or :class:`ApiError` (400) saying why not."""
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError("the body is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ApiError(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError("the body's JSON is nested too deeply; no field of this API nests "
                       "more than a few levels") from None
    except ValueError:      # int('9' * 5000): the str -> int digit limit
        raise ApiError(f"the body has an integer of more than {sys.get_int_max_str_digits()} "
                       f"digits; no field of this API takes one") from None
    if _SURROGATE_ESCAPE.search(raw):       # the walk only where one may be (UTF-8 has none)
        _refuse_lone_surrogates(value)
    return value


def _refuse_lone_surrogates(value: Any) -> None:
    """:class:`ApiError` (400) when a string of ``value`` (a key or a value, at any depth)
    holds a lone surrogate. Walked with a stack: the parser's nesting limit is about the
    interpreter's recursion limit, which a recursive walk would pass."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ApiError(f"the body has a string with a lone UTF-16 surrogate "
                               f"({ascii(exc.object[exc.start])}): not a Unicode character; "
                               f"escape a character beyond U+FFFF as a surrogate pair") \
                    from None


async def read_json(request: web.Request, timeout: float,
                    check: Callable[[Any], Checked]) -> Checked:
    """``check`` of the request's body as a JSON value (module docstring)."""
    coding = request.headers.get("Content-Encoding", "").strip().lower()
    if coding not in ("", "identity"):
        raise ApiError(f"Content-Encoding {coding[:40]!r}: this API takes the body as sent, "
                       f"uncompressed", 415)
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except TimeoutError:
        raise ApiError(f"the body did not arrive within {timeout:g} s "
                       f"(front.body_timeout_seconds)", 408) from None
    except web.RequestPayloadError:     # e.g. a broken chunked framing
        raise ApiError("the body could not be read as sent: its chunked framing is "
                       "broken") from None
    if len(raw) <= OFF_LOOP_BYTES:
        return check(decode(raw))
    return await asyncio.get_running_loop().run_in_executor(PARSER,
                                                            lambda: check(decode(raw)))

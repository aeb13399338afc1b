"""Request bodies of the HTTP front (OpenAI's ``/v1/completions`` and ``/v1/chat/completions``,
the deployment guide's ``/v1/inference``) -> one :class:`Generation`: read and decoded
within bounds (:func:`read_json`), then validated by the pydantic models of
:mod:`.openai_models` with the served engine's bounds (:func:`parse`).

Reading (:func:`read_json`): a request's JSON body, read and parsed within bounds: at most
``MAX_BODY_BYTES`` (aiohttp's ``client_max_size``: 413), arriving within
``body_timeout_seconds`` (else 408), framed as its headers say, not compressed (a
``Content-Encoding`` is a 415, refused unread: the front's runner leaves bodies as sent,
``auto_decompress`` off, so no gzip bomb is inflated), UTF-8, and JSON that Python's parser
takes (else 400 naming the problem: not JSON, nested deeper than the
parser's recursion limit, an integer of more than ``sys.get_int_max_str_digits()`` digits, a
string with a lone surrogate: a ``\\uD800``-``\\uDFFF`` escape not paired into one
character, which JSON's grammar allows and UTF-8 cannot encode, so no string of a parsed
body fails to encode later). The value is then checked by the caller's ``check`` (a request
model's validation). A body over ``OFF_LOOP_BYTES`` is decoded and checked on ``PARSER``,
one thread, so at most one parse's worth of objects is alive at a time; ``json.loads``
holds the GIL while it parses, so the event loop's other clients (streams, the doors,
``/metrics``) wait for it (~0.2-0.4 s for a 10 MiB body of small ints, rev27k M3). So a body
is first held to the served engine's :class:`BodyBounds` (the app's ``BODY_BOUNDS``): longer
than any request to it needs, a 413 from its ``Content-Length``, unread; of more JSON values
than any needs, a 400 counted from its bytes (:func:`json_size`, ~30 ms a 10 MiB body),
never parsed: what is parsed costs at most ~40 ns a value the engine could use.

Invariants: a body this module accepts is a JSON object whose every field is known, of its
type and in its range (:mod:`.openai_models` has the bounds), so what reaches the server
cannot fail on input; anything else raises :class:`ApiError` (status 400, or 404 for a model
this server does not serve) whose message names the field (``param``: the top-level one)
and what is wrong. A field OpenAI defines that this server cannot honour (``best_of``,
tools, ``min_p``, ...) is accepted only at its
default, else refused by name, never silently ignored. Defaults are OpenAI's: ``max_tokens`` 16 for
completions, the rest of the engine's ``max_seq_len`` for chat; ``temperature`` 1 (the
guide's ``/v1/inference``: 0, greedy); ``top_p`` 1. vLLM's and trtllm-serve's extensions
are taken as they take them: ``ignore_eos`` (``max_tokens`` tokens whatever comes),
``top_k`` (-1 or 0: off), ``min_tokens``, ``repetition_penalty`` (1: off), ``cache_salt``
(a cached prefix is shared only among requests
with the same salt, vLLM's per-tenant isolation). ``logprobs``
(completions: 0-5; chat: true, with ``top_logprobs`` 0-20) asks for the log-probability of
each generated token and of its N most likely alternatives, the raw model's
(:mod:`.generation_routes`); with vLLM's ``return_tokens_as_token_ids`` they name each token
``token_id:N`` instead of its text (a client that needs the ids: a byte of a character has
no text of its own). ``echo`` with ``logprobs`` N (completions)
also asks for the prompt's tokens' log-probs with N alternatives each (:attr:`Generation.
prompt_logprobs`; lm-eval's loglikelihood requests), which a context server computes. A
prompt is text or token ids (a list of ints); a list of such prompts is several, and each
prompt gets ``n`` choices, at most ``MAX_CHOICES`` in all, indexed prompt by prompt
(:meth:`Generation.choices`), not streamed. An error message shows a value cut to
``SHOWN_CHARS`` characters, however large or deep it is; its ``code`` is OpenAI's string.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, TypeVar
# Any here: decoded JSON values, checked by whoever reads them.

from aiohttp import web
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from triton_disagg.front.field_checks import shown
from triton_disagg.front.openai_models import (BRANCHES, MAX_CHOICES, EngineLimits,
                                               request_model)


class ApiError(Exception):
    """A request the front refuses: ``status`` and an OpenAI error ``type``/``param``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind
        self.headers = headers or {}

    def body(self) -> dict:
        """OpenAI's error JSON; ``code`` a string as OpenAI's (``model_not_found`` for a
        model not served, else the ``type``)."""
        code = "model_not_found" if self.status == 404 and self.param == "model" else self.kind
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": code}}


@dataclass(frozen=True)
class Generation:
    """One request, whichever endpoint it came in on. ``prompts``: each text or token ids
    (a chat's rendered by the chat template later: ``messages`` set, one empty prompt),
    ``n`` choices each;
    ``max_tokens`` None: the endpoint's default; ``logprobs`` None: none returned, else how
    many alternatives were asked per token; ``echo``: the prompt's text starts the
    completion's; ``sampling``: ensemble input names -> values, only those given."""

    endpoint: str                        # "completions" | "chat" | "inference"
    model: str | None
    prompts: tuple[str | tuple[int, ...], ...] = ("",)
    n: int = 1
    messages: tuple[dict, ...] = ()
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    tokens_as_ids: bool = False          # log-probs name tokens "token_id:N", not their text
    echo: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_logprobs(self) -> int | None:
        """How many alternatives per prompt token when the prompt's own log-probs are asked
        for (``echo`` with ``logprobs``), else None."""
        return self.logprobs if self.echo else None

    @property
    def prompt(self) -> str | tuple[int, ...]:
        """The first (a single choice's only) prompt."""
        return self.prompts[0]

    def choices(self) -> list["Generation"]:
        """One single-prompt generation per choice, in OpenAI's order of ``index``: each
        prompt's ``n`` in turn. With a ``seed``, choice ``i`` draws with ``seed + i``, so
        the choices of a seeded request differ and repeat."""
        out = []
        for i, prompt in enumerate(p for p in self.prompts for _ in range(self.n)):
            seed = {"seed": (self.sampling["seed"] + i) % 2**64} if "seed" in self.sampling else {}
            out.append(replace(self, prompts=(prompt,), n=1, sampling=self.sampling | seed))
        return out


# pydantic's error types -> what the value should have been
_EXPECTED = {"int_type": "an integer", "bool_type": "true or false", "string_type": "a string",
             "float_type": "a number", "finite_number": "a finite number", "list_type": "a list",
             "model_type": "an object", "model_attributes_type": "an object",
             "dict_type": "an object"}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}
_LENGTHS = {"too_short": ("at least", "min_length", "list"),
            "too_long": ("at most", "max_length", "list"),
            "string_too_short": ("at least", "min_length", "string"),
            "string_too_long": ("at most", "max_length", "string")}
_UNITS = {"list": "items", "string": "characters"}
# the fields handed to the engine under their own names (the ensemble's inputs), when given
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
             "min_tokens", "repetition_penalty", "cache_salt")


def parse(endpoint: str, body: Any, limits: EngineLimits = EngineLimits()) -> Generation:
    """A decoded JSON body of ``endpoint`` ("completions", "chat", "inference") -> its
    :class:`Generation` within ``limits``; raises :class:`ApiError` (400) naming the first
    wrong field."""
    model = request_model(endpoint, limits)
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise _refusal(exc.errors(include_url=False)[0], endpoint, model) from None
    given = request.model_fields_set
    sampling = {name: getattr(request, name) for name in _SAMPLING if name in given}
    if sampling.get("top_k") == -1:
        sampling["top_k"] = 0                   # vLLM's "off"; the engine's is 0
    if "cache_salt" in sampling:
        sampling["cache_salt"] = sampling["cache_salt"].encode("utf-8")   # the engine's BYTES
    if endpoint != "inference":
        sampling = {"temperature": 1.0} | sampling
    options = getattr(request, "stream_options", None)
    return Generation(
        endpoint=endpoint, model=request.model, prompts=request.prompts(),
        n=getattr(request, "n", 1),
        messages=tuple({"role": m.role, "content": m.text()}
                       for m in getattr(request, "messages", ())),
        max_tokens=request.generated_max(), stream=getattr(request, "stream", False),
        include_usage=options is not None and options.include_usage,
        stop=_stop_words(request.stop), ignore_eos=getattr(request, "ignore_eos", False),
        logprobs=request.logprobs_asked(), echo=getattr(request, "echo", False),
        tokens_as_ids=getattr(request, "return_tokens_as_token_ids", False),
        sampling=sampling)


def _stop_words(stop: str | list[str] | None) -> tuple[str, ...]:
    words = [stop] if isinstance(stop, str) else stop or []
    return tuple(w for w in words if w)


def _refusal(error: dict, endpoint: str, model: type[BaseModel]) -> ApiError:
    """pydantic's ``error`` -> the 400 naming the field (its path, as ``messages[0].role``)
    and what is wrong; ``param`` the top-level field."""
    path = [p for p in error["loc"] if p not in BRANCHES]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    kind, ctx, value = error["type"], error.get("ctx") or {}, error["input"]
    param = ctx.get("param") or (path[0] if path else None)
    named = shown(where or param)     # quoted; bounded: an unknown field's name is the client's
    if kind == "model_type" and not path:
        return ApiError(f"the body must be a JSON object, got {type(value).__name__}")
    if kind == "missing":
        return ApiError(f"{named} is required", param=param)
    if kind == "extra_forbidden":
        route = "/v1/" + endpoint.replace("chat", "chat/completions")
        return ApiError(f"{named}: unknown field" + ("" if len(path) > 1 else f" for {route}"),
                        param=param)
    field = model.model_fields.get(param) if isinstance(param, str) and len(path) == 1 else None
    if kind in _EXPECTED:
        what = f"expected {_EXPECTED[kind]}, got {type(value).__name__} {shown(value)}"
    elif kind in _BOUNDS:
        sign, key = _BOUNDS[kind]
        what = f"{shown(value)} must be {_range(field) or f'{sign} {ctx[key]}'}"
    elif kind in _LENGTHS:
        most, key, unit = _LENGTHS[kind]
        what = f"expected a non-empty {unit}" if kind in ("too_short", "string_too_short") \
            and ctx[key] == 1 else f"{len(value)} {_UNITS[unit]}; {most} {ctx[key]}"
    elif kind == "wrong_type":      # a union's value of none of its JSON types
        what = f"{error['msg']}, got {type(value).__name__} {shown(value)}"
    elif kind == "literal_error":
        what = f"{shown(value)} is not one of {ctx['expected']}"
    else:           # this project's own errors (openai_models) and any other: pydantic's words
        what = error["msg"]
    why = f" ({field.description})" if field is not None and field.description and \
        (kind in _BOUNDS or kind in _LENGTHS) else ""
    return ApiError(f"{named}: {what}{why}", param=param)


def _range(field: FieldInfo | None) -> str | None:
    """A top-level field's bounds in words ("between 1 and 8", "in (0.0, 1.0]"), None
    unless it has both."""
    bounds = {key: getattr(m, key) for m in (field.metadata if field else ())
              for key in ("ge", "gt", "le", "lt") if hasattr(m, key)}
    low, high = bounds.get("ge", bounds.get("gt")), bounds.get("le", bounds.get("lt"))
    if low is None or high is None:
        return None
    if isinstance(low, int) and isinstance(high, int) and {"ge", "le"} <= set(bounds):
        return f"between {low} and {high}"
    return f"in {'(' if 'gt' in bounds else '['}{low}, {high}{')' if 'lt' in bounds else ']'}"


# ---- the body, read and decoded within bounds

MAX_BODY_BYTES = 10 * 2**20     # a larger body is refused with 413
OFF_LOOP_BYTES = 64 * 2**10     # a larger body is parsed on PARSER, not the event loop
ESCAPED_CHAR_BYTES = 12         # JSON's longest spelling of a character: a surrogate pair
BODY_SLACK_BYTES = 2**20        # a body's bytes besides its prompts' text, and more
VALUES_SLACK = 2**17            # a body's JSON values besides its token ids and messages
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")   # \uD800-\uDFFF, either case
PARSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="json-body")
# what read_json calls once the request's body is all here (the request gate's: http_gates)
BODY_ARRIVED = web.RequestKey("body_arrived", Callable[[], None])
Checked = TypeVar("Checked")


@dataclass(frozen=True)
class BodyBounds:
    """What a body may hold before it is read or parsed: at most ``max_bytes`` (413 from its
    ``Content-Length``, unread) and at most ``max_values`` JSON values (twice as many
    strings; 400, counted from its bytes by :func:`json_size` before ``json.loads``, which
    holds the GIL, and so the event loop, for as long as it parses: ~40 ns a value)."""

    max_bytes: int = MAX_BODY_BYTES
    max_values: int = 2**31

    @classmethod
    def of(cls, limits: EngineLimits, max_prompt_chars: int) -> "BodyBounds":
        """The largest body of any route the served engine can take, with slack: at most
        ``MAX_CHOICES`` prompts of ``max_prompt_chars`` characters, each spelled in JSON's
        longest escape (``max_prompt_chars`` is at least 64 a token, so this also covers
        prompts of ``max_seq_len`` token ids, a chat's ``max_seq_len`` messages and every
        other field); values: ``MAX_CHOICES`` prompts of ``max_seq_len`` ids and a chat's
        messages (a few values each), plus ``VALUES_SLACK``."""
        text = MAX_CHOICES * max_prompt_chars * ESCAPED_CHAR_BYTES
        return cls(min(MAX_BODY_BYTES, text + BODY_SLACK_BYTES),
                   (MAX_CHOICES + 8) * limits.max_seq_len + VALUES_SLACK)

    def screen(self, raw: bytes) -> None:
        """:class:`ApiError` (400) for a body of more JSON values (or strings) than
        ``max_values`` (twice)."""
        strings, values = json_size(raw, 2 * self.max_values)
        if strings > 2 * self.max_values or values > self.max_values:
            what = f"{strings} strings" if strings > 2 * self.max_values else \
                f"{values} values"
            raise ApiError(f"the body's JSON has {what}; no request to this engine needs "
                           f"more than {self.max_values} values ({2 * self.max_values} "
                           f"strings)")


# the served engine's (the front's make_app sets them); without: MAX_BODY_BYTES alone
BODY_BOUNDS = web.AppKey("body_bounds", BodyBounds)


def json_size(text: bytes, max_strings: int) -> tuple[int, int]:
    """(strings, values) of a JSON text, from its bytes: its strings, keys included (its
    quotes, halved, once each escaped backslash and escaped quote is blanked: no quote is
    left inside a string), and, if those are at most ``max_strings`` (else 0: they are
    counted on the text split at its quotes, an object per piece), an upper bound on its
    values of every kind, from what lies outside its strings (each value but a container's
    first follows a comma: 1 + commas + ``[`` + ``{``). Past a byte that is no JSON either
    may be wrong, but Triton's parser stops there."""
    unescaped = text.replace(b"\\\\", b"__").replace(b'\\"', b"__")   # same offsets
    strings = (unescaped.count(b'"') + 1) // 2          # an unclosed one counts
    if strings > max_strings:
        return strings, 0
    outside = b"".join(unescaped.split(b'"')[::2])      # the text less its strings
    return strings, 1 + outside.count(b",") + outside.count(b"[") + outside.count(b"{")




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
    bounds = request.app.get(BODY_BOUNDS) or BodyBounds()
    if (request.content_length or 0) > bounds.max_bytes:
        raise _too_large(bounds)
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except TimeoutError:
        raise ApiError(f"the body did not arrive within {timeout:g} s "
                       f"(front.body_timeout_seconds)", 408) from None
    except web.RequestPayloadError:     # e.g. a broken chunked framing
        raise ApiError("the body could not be read as sent: its chunked framing is "
                       "broken") from None
    request.get(BODY_ARRIVED, lambda: None)()
    if len(raw) > bounds.max_bytes:         # chunked: no Content-Length to refuse it by
        raise _too_large(bounds)
    if len(raw) <= OFF_LOOP_BYTES:
        return check(decode(raw))

    def screened() -> Checked:
        bounds.screen(raw)
        return check(decode(raw))
    return await asyncio.get_running_loop().run_in_executor(PARSER, screened)


def _too_large(bounds: BodyBounds) -> ApiError:
    return ApiError(f"the body is over {bounds.max_bytes} bytes, more than any request to "
                    f"this engine needs ({MAX_CHOICES} prompts of its longest, each character "
                    f"escaped)", 413)

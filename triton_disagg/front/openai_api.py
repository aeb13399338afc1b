"""Request bodies of the HTTP front (OpenAI's ``/v1/completions`` and ``/v1/chat/completions``,
the deployment guide's ``/v1/inference``) -> one :class:`Generation`, checked field by field.

Invariants: a body this module accepts is a JSON object whose every field is known, of its
type and in its range, so what reaches the server cannot fail on input; anything else raises
:class:`ApiError` (status 400, or 404 for a model this server does not serve) whose message
names the field and the fix. A field OpenAI defines that this server cannot honour
(``best_of``, tools, ``min_p``, ...) is accepted only at its
default, else refused by name, never silently ignored. Defaults are OpenAI's: ``max_tokens`` 16 for
completions, the rest of the engine's ``max_seq_len`` for chat; ``temperature`` 1 (the
guide's ``/v1/inference``: 0, greedy); ``top_p`` 1. vLLM's and trtllm-serve's extensions
are taken as they take them: ``ignore_eos`` (``max_tokens`` tokens whatever comes),
``top_k`` (-1 or 0: off), ``min_tokens``, ``repetition_penalty`` (1: off), ``cache_salt``
(at most ``MAX_CACHE_SALT`` characters: a cached prefix is shared only among requests
with the same salt, vLLM's per-tenant isolation). ``logprobs``
(completions: 0-5; chat: true, with ``top_logprobs`` 0-20) asks for the log-probability of
each generated token; the engine computes the chosen token's alone, so ``top_logprobs``
lists that token only (:mod:`.openai_responses`). ``echo`` with ``logprobs`` N (completions)
also asks for the prompt's tokens' log-probs with N alternatives each (:attr:`Generation.
prompt_logprobs`; lm-eval's loglikelihood requests), which a context server computes. A prompt is text or token ids (a list of
ints); a list of such prompts is several, and each prompt gets ``n`` choices, at most
``MAX_CHOICES`` in all, indexed prompt by prompt (:meth:`Generation.choices`), not
streamed; token ids must be in the vocabulary. Every number is bounded before it is used: ``max_tokens`` and ``min_tokens``
by the engine's ``max_seq_len`` less one prompt token, ``top_k`` and token ids by its
vocabulary (:class:`EngineLimits`); ``stop`` holds at most ``MAX_STOP_WORDS`` words of at
most ``MAX_STOP_CHARS`` characters, ``messages`` at most ``max_seq_len`` messages, a
token-id prompt at most ``max_seq_len`` ids. An error message shows a value cut to
``SHOWN_CHARS`` characters, however large or deep it is; its ``code`` is OpenAI's string.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from triton_disagg.engine.sampling import MAX_CACHE_SALT

COMPLETION_MAX_TOKENS = 16      # OpenAI's default for /v1/completions
MAX_LOGPROBS = 5                # OpenAI's limit on completions' ``logprobs``
MAX_TOP_LOGPROBS = 20           # OpenAI's limit on chat's ``top_logprobs``
MAX_CHOICES = 8                 # prompts x n of one request: each is one engine request
MAX_STOP_WORDS = 4              # OpenAI's limit on ``stop``
MAX_STOP_CHARS = 256            # per stop sequence
SHOWN_CHARS = 60                # of a value quoted in an error message
INT32_MAX = 2**31 - 1
_SHOW = reprlib.Repr()         # Python 3.11's takes no arguments
_SHOW.maxlevel, _SHOW.maxstring = 2, SHOWN_CHARS
_SHOW.maxother = _SHOW.maxlong = SHOWN_CHARS


@dataclass(frozen=True)
class EngineLimits:
    """The engine's bounds on a request (:class:`~triton_disagg.front.prepare.RequestEncoder`
    has the served engine's); the defaults are those of the tensors' INT32."""

    max_seq_len: int = INT32_MAX
    vocab_size: int = INT32_MAX


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


# ---- field checks: (value, name) -> value, or raise ApiError naming the field --------------
# Each carries the JSON schema of what it accepts (``json_schema``): the OpenAPI document's
# (:func:`body_schema`), so the document and the checks cannot drift apart.

Check = Callable[[Any, str], Any]


def _schema(check: Check, schema: dict) -> Check:
    check.json_schema = schema  # type: ignore[attr-defined]
    return check


def _bad(name: str, want: str, value: Any) -> ApiError:
    return ApiError(f"'{name}': expected {want}, got {type(value).__name__} {_show(value)}",
                    param=name)


def _show(value: Any) -> str:
    """``value``'s repr, never more than ``SHOWN_CHARS`` characters, built without
    rendering all of a large or deep value."""
    text = _SHOW.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def _string(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise _bad(name, "a string", value)
    return value


def _salt(value: Any, name: str) -> bytes:
    """A ``cache_salt``: a non-empty string of at most ``MAX_CACHE_SALT`` characters, as the
    engine's UTF-8 BYTES input."""
    if not isinstance(value, str) or not value or len(value) > MAX_CACHE_SALT:
        raise _bad(name, f"a non-empty string of at most {MAX_CACHE_SALT} characters", value)
    return value.encode("utf-8")


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(name, "true or false", value)
    return value


def _int(low: int, high: int | None = None, why: str = "") -> Check:
    def check(value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(name, "an integer", value)
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"between {low} and {high}"
            raise ApiError(f"'{name}': {_show(value)} must be {bound}{why}", param=name)
        return value
    bounds = {"minimum": low} | ({"maximum": high} if high is not None else {})
    return _schema(check, {"type": "integer", **bounds})


def _number(low: float, high: float, low_open: bool = False) -> Check:
    def check(value: Any, name: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _bad(name, "a number", value)
        if value < low or value > high or (low_open and value == low):
            left = "(" if low_open else "["
            raise ApiError(f"'{name}': {_show(value)} must be in {left}{low}, {high}]",
                           param=name)
        return float(value)
    return _schema(check, {"type": "number", "exclusiveMinimum" if low_open else "minimum": low,
                           "maximum": high})


def _stop(value: Any, name: str) -> tuple[str, ...]:
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise _bad(name, "a string or a list of strings", value)
    if len(words) > MAX_STOP_WORDS:
        raise ApiError(f"'{name}': at most {MAX_STOP_WORDS} stop sequences, got {len(words)}",
                       param=name)
    if any(len(w) > MAX_STOP_CHARS for w in words):
        raise ApiError(f"'{name}': a stop sequence has at most {MAX_STOP_CHARS} characters",
                       param=name)
    return tuple(w for w in words if w)


def _stream_options(value: Any, name: str) -> bool:
    """``stream_options`` -> include_usage."""
    if not isinstance(value, dict):
        raise _bad(name, "an object", value)
    unknown = set(value) - {"include_usage"}
    if unknown:
        raise ApiError(f"'{name}.{sorted(unknown)[0]}': unknown field; only include_usage is "
                       f"supported", param=name)
    return _bool(value.get("include_usage", False), f"{name}.include_usage")


def _prompt(limits: EngineLimits) -> Check:
    """Prompts (OpenAI's four forms: a string, a list of token ids, and a list of either,
    at most ``MAX_CHOICES``); ids checked against the vocabulary and counted before they
    are kept."""
    def check(value: Any, name: str) -> tuple[str | tuple[int, ...], ...]:
        if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
            if len(value) > MAX_CHOICES:
                raise ApiError(f"'{name}': {len(value)} prompts; at most {MAX_CHOICES} per "
                               f"request", param=name)
            return tuple(one(p, f"{name}[{i}]") for i, p in enumerate(value))
        return (one(value, name),)

    def one(value: Any, name: str) -> str | tuple[int, ...]:
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise _bad(name, "a string or a non-empty list of token ids", value)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            raise _bad(name, "a list of integer token ids", value)
        if len(value) > limits.max_seq_len:
            raise ApiError(f"'{name}': {len(value)} token ids; at most {limits.max_seq_len} "
                           f"(this engine's max_seq_len)", param=name)
        bad = next((i for i in value if not 0 <= i < limits.vocab_size), None)
        if bad is not None:
            raise ApiError(f"'{name}': token id {_show(bad)} is not in this model's "
                           f"vocabulary (0 to {limits.vocab_size - 1})", param=name)
        return tuple(value)
    ids = {"type": "array", "minItems": 1, "maxItems": limits.max_seq_len,
           "items": {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}}
    several = {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES}
    return _schema(check, {"oneOf": [{"type": "string"}, ids,
                                     {**several, "items": {"type": "string"}},
                                     {**several, "items": ids}]})


_ROLES = ("system", "developer", "user", "assistant")
_schema(_string, {"type": "string"})
_schema(_bool, {"type": "boolean"})
_schema(_salt, {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT})
_schema(_stop, {"oneOf": [{"type": "string", "maxLength": MAX_STOP_CHARS},
                          {"type": "array", "maxItems": MAX_STOP_WORDS,
                           "items": {"type": "string", "maxLength": MAX_STOP_CHARS}}]})
_schema(_stream_options, {"type": "object", "additionalProperties": False,
                          "properties": {"include_usage": {"type": "boolean"}}})


def _messages(limit: int) -> Check:
    def check(value: Any, name: str) -> tuple[dict, ...]:
        if not isinstance(value, list) or not value:
            raise _bad(name, "a non-empty list of messages", value)
        if len(value) > limit:
            raise ApiError(f"'{name}': {len(value)} messages; at most {limit} (this engine's "
                           f"max_seq_len)", param=name)
        return _each_message(value, name)
    part = {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"const": "text"}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "additionalProperties": False,
               "properties": {"role": {"enum": list(_ROLES)}, "name": {"type": "string"},
                              "content": {"oneOf": [{"type": "string"},
                                                    {"type": "array", "items": part}]}}}
    return _schema(check, {"type": "array", "minItems": 1, "maxItems": limit, "items": message})


def _each_message(value: list, name: str) -> tuple[dict, ...]:
    out = []
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, "an object with role and content", message)
        unknown = set(message) - {"role", "content", "name"}
        if unknown:
            raise ApiError(f"'{where}.{sorted(unknown)[0]}': not supported (text messages: "
                           f"role, content, name)", param=name)
        role = _string(message.get("role"), f"{where}.role")
        if role not in _ROLES:
            raise ApiError(f"'{where}.role': {role!r} is not one of {', '.join(_ROLES)}",
                           param=name)
        out.append({"role": role, "content": _content(message.get("content"), f"{where}.content")})
    return tuple(out)


def _content(value: Any, name: str) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(name, "a string or a list of text parts", value)
    texts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ApiError(f"'{name}[{i}]': only text parts ({{\"type\": \"text\", \"text\": "
                           f"...}}) are supported", param=name)
        texts.append(_string(part.get("text"), f"{name}[{i}].text"))
    return "".join(texts)


def _fields(endpoint: str, limits: EngineLimits) -> dict[str, Check]:
    """``endpoint``'s fields -> their checks; each returns the value kept under that name."""
    max_tokens = _int(1, limits.max_seq_len - 1,
                      f" (this engine's max_seq_len {limits.max_seq_len} less a prompt token)")
    sampling = {"temperature": _number(0.0, 2.0), "top_p": _number(0.0, 1.0, low_open=True),
                "seed": _int(0, 2**64 - 1),
                "top_k": _int(-1, limits.vocab_size, " (-1 or 0: off; the vocabulary's size)")}
    if endpoint == "inference":
        return {"model": _string, "prompt": _string, "max_tokens": max_tokens, "stop": _stop,
                **sampling}
    common = {
        "model": _string, "stream": _bool, "stream_options": _stream_options, "stop": _stop,
        "presence_penalty": _number(-2.0, 2.0), "frequency_penalty": _number(-2.0, 2.0),
        "user": _string, "max_tokens": max_tokens, "n": _int(1, MAX_CHOICES), **sampling,
        # vLLM's and trtllm-serve's extensions, as they take them in the body
        "ignore_eos": _bool,     # max_tokens tokens, always
        "min_tokens": _int(0, limits.max_seq_len - 1, " (this engine's max_seq_len less one)"),
        "repetition_penalty": _number(0.0, 2.0, low_open=True),
        "cache_salt": _salt,     # vLLM's: a prefix is reused only under the same salt
    }
    if endpoint == "completions":
        return {**common, "prompt": _prompt(limits), "echo": _bool,
                "logprobs": _int(0, MAX_LOGPROBS)}
    return {**common, "messages": _messages(limits.max_seq_len),
            "max_completion_tokens": max_tokens, "logprobs": _bool,
            "top_logprobs": _int(0, MAX_TOP_LOGPROBS)}


# OpenAI fields this server honours only at their default: field -> (accepted values, why)
_ONLY_DEFAULT = {
    "best_of": ((1, None), "best_of is not supported; send best_of 1"),
    "min_p": ((None, 0, 0.0), "min_p is not supported by this engine's sampler; send min_p 0"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    "logit_bias": ((None,), "logit_bias is not supported"),
    "tools": ((None,), "tool calls are not supported"),
    "tool_choice": ((None, "none"), "tool calls are not supported"),
    "parallel_tool_calls": ((None,), "tool calls are not supported"),
    "functions": ((None,), "function calls are not supported"),
    "function_call": ((None, "none"), "function calls are not supported"),
    "response_format": ((None, {"type": "text"}), "only text responses are supported"),
}
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
             "min_tokens", "repetition_penalty", "cache_salt")
_REQUIRED = {"completions": ("model", "prompt"), "chat": ("model", "messages"),
             "inference": ("prompt",)}


def parse(endpoint: str, body: Any, limits: EngineLimits = EngineLimits()) -> Generation:
    """A decoded JSON body of ``endpoint`` ("completions", "chat", "inference") -> its
    :class:`Generation` within ``limits``; raises :class:`ApiError` (400) naming the first
    wrong field."""
    if not isinstance(body, dict):
        raise ApiError(f"the body must be a JSON object, got {type(body).__name__}")
    fields = _fields(endpoint, limits)
    for name, value in body.items():
        if name in fields or (name in _ONLY_DEFAULT and endpoint != "inference"):
            continue
        raise ApiError(f"'{name}': unknown field for /v1/{endpoint.replace('chat', 'chat/completions')}",
                       param=name)
    for name in _REQUIRED[endpoint]:
        if body.get(name) is None:
            raise ApiError(f"'{name}' is required", param=name)
    for name, (fine, why) in _ONLY_DEFAULT.items():
        if name in body and not any(body[name] == f and type(body[name]) is type(f)
                                    for f in fine):
            raise ApiError(f"'{name}' {_show(body[name])}: {why}", param=name)
    v = {name: check(body[name], name) for name, check in fields.items()
         if body.get(name) is not None}
    if v.get("stream_options") and not v.get("stream"):
        raise ApiError("'stream_options': only allowed with stream true", param="stream_options")
    logprobs = _logprobs(endpoint, v)
    prompts = v.get("prompt", ("",)) if endpoint != "inference" else (v["prompt"],)
    n = v.get("n", 1)
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(f"'n': {len(prompts)} prompts x n {n} is more than {MAX_CHOICES} "
                       f"choices per request", param="n")
    if len(prompts) * n > 1 and v.get("stream"):
        raise ApiError("'stream': one choice per streamed request (one prompt, n 1); send "
                       "stream false for several", param="stream")
    if v.get("top_k") == -1:
        v["top_k"] = 0                  # vLLM's "off"; the engine's is 0
    return Generation(
        endpoint=endpoint, model=v.get("model"), prompts=prompts, n=n,
        messages=v.get("messages", ()),
        max_tokens=v.get("max_completion_tokens", v.get("max_tokens")),
        stream=v.get("stream", False), include_usage=v.get("stream_options", False),
        stop=v.get("stop", ()), ignore_eos=v.get("ignore_eos", False),
        logprobs=logprobs, echo=v.get("echo", False),
        sampling={name: v[name] for name in _SAMPLING if name in v}
        | ({"temperature": 1.0} if endpoint != "inference" and "temperature" not in v else {}))


def _logprobs(endpoint: str, v: dict[str, Any]) -> int | None:
    """How many alternatives per token the request asked for, None for no log-probs:
    completions' ``logprobs`` N; chat's ``top_logprobs`` N (0 by default) with ``logprobs``
    true, and only then (OpenAI's rule)."""
    if endpoint != "chat":
        return v.get("logprobs")
    if "top_logprobs" in v and not v.get("logprobs"):
        raise ApiError("'top_logprobs': only allowed with logprobs true", param="top_logprobs")
    return v.get("top_logprobs", 0) if v.get("logprobs") else None


def body_schema(endpoint: str, limits: EngineLimits = EngineLimits()) -> dict:
    """The JSON schema of ``endpoint``'s body as :func:`parse` checks it, for the OpenAPI
    document: each field's type and bounds, the required ones, and a field honoured only at
    its default as the enum of those defaults."""
    properties = {name: check.json_schema  # type: ignore[attr-defined]
                  for name, check in _fields(endpoint, limits).items()}
    if endpoint != "inference":
        properties |= {name: {"enum": list(fine), "description": why}
                       for name, (fine, why) in _ONLY_DEFAULT.items()}
    return {"type": "object", "properties": properties, "required": list(_REQUIRED[endpoint]),
            "additionalProperties": False}

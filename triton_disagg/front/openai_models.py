"""The HTTP front's request bodies as pydantic models: OpenAI's ``/v1/completions``
(:class:`CompletionRequest`) and ``/v1/chat/completions`` (:class:`ChatRequest`), the
guide's ``/v1/inference`` (:class:`InferenceRequest`); :func:`request_model` bounds them by
the served engine (:class:`EngineLimits`). They also give the OpenAPI document's body
schemas (:mod:`.openapi`), so the document and the checks cannot drift apart. Their
building blocks come first: JSON as sent (:class:`StrictModel`), the field types bounded by
the engine (``*_field``, :func:`token_ids`), a chat's messages; the checks that fields share
are :mod:`.field_checks`.

Invariants: a body validates only as a JSON object whose every field is known (else
``extra_forbidden``), of its JSON type (strict: no ``"5"`` for 5, no ``true`` for 1, no NaN)
and in its range (the engine's ``max_seq_len`` and vocabulary, ``MAX_*`` here); a field sent
as ``null`` is as if not sent. Every number is bounded before it is used, every list before
its items are looked at (its length first, a chat's content parts on the raw JSON first),
and stops at its first bad item (:func:`~.field_checks.bounded_list`): a refused body has a
few errors, never one per item. A field OpenAI defines that this server cannot honour
(``best_of``, tools, ``min_p``, ...) validates only at its default
(:func:`~.field_checks.only_default`); a rule between fields fails as a ``refused`` error
whose ``ctx["param"]`` names the field (:func:`~.field_checks.refused`).
"""

import functools
from dataclasses import dataclass
from typing import Annotated, Any, Callable, ClassVar, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator,
                      Field, Tag, WithJsonSchema, create_model, model_validator)
from pydantic_core import PydanticCustomError

from triton_disagg.engine.sampling import MAX_CACHE_SALT
from triton_disagg.front.field_checks import bounded_list, by_form, only_default, refused, shown

MAX_CHOICES = 8                 # prompts x n of one request: each is one engine request
MAX_TEXT_PARTS = 256            # a chat message's content parts
MAX_TEXT_PARTS_TOTAL = 1024     # content parts of all of a chat's messages
INT32_MAX = 2**31 - 1
COMPLETION_MAX_TOKENS = 16      # OpenAI's default for /v1/completions
MAX_LOGPROBS = 5                # OpenAI's limit on completions' ``logprobs``
MAX_TOP_LOGPROBS = 20           # OpenAI's limit on chat's ``top_logprobs``
MAX_STOP_WORDS = 4              # OpenAI's limit on ``stop``
MAX_STOP_CHARS = 256            # per stop sequence
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
    text, ids = Annotated[str, Tag("one text")], Annotated[token_ids(limits), Tag("token ids")]
    one = Annotated[text | ids, by_form({str: "one text", list: "token ids"},
                                        "expected a string or a list of token ids")]

    def form(value: Any) -> str | None:
        if isinstance(value, str):
            return "one text"
        if isinstance(value, list):
            return "several prompts" if value and isinstance(value[0], (str, list)) \
                else "token ids"
        return None
    several = Annotated[list[one], Field(min_length=1, max_length=MAX_CHOICES)]
    return Annotated[text | ids | Annotated[several, Tag("several prompts")],
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


# ---- the request bodies ---------------------------------------------------------------

class StreamOptions(StrictModel):
    include_usage: bool = False


_ANY_ENGINE = EngineLimits()
# the engine-bounded fields' types for any engine (request_model narrows them to one)
MaxTokens, MinTokens = max_tokens_field(_ANY_ENGINE), min_tokens_field(_ANY_ENGINE)
TopK, Prompt, Messages = top_k_field(_ANY_ENGINE), prompt_field(_ANY_ENGINE), \
    messages_field(_ANY_ENGINE)
Stop = Annotated[Annotated[str, Field(max_length=MAX_STOP_CHARS), Tag("one stop")]
                 | Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]],
                             Field(max_length=MAX_STOP_WORDS), Tag("stop words")],
                 by_form({str: "one stop", list: "stop words"},
                          "expected a string or a list of strings")]
Penalty = Annotated[float | None, Field(ge=-2.0, le=2.0)]


class _Sampled(StrictModel):
    """What every generation endpoint takes."""

    # the fields whose bounds are the served engine's -> their type for an engine's limits
    # (:func:`request_model` narrows them; the annotations are any engine's)
    ENGINE_BOUNDED: ClassVar[dict[str, Callable[[EngineLimits], Any]]] = {
        "max_tokens": max_tokens_field, "top_k": top_k_field}
    model: str | None = None
    max_tokens: MaxTokens = None
    stop: Stop | None = None
    temperature: Annotated[float | None, Field(ge=0.0, le=2.0)] = None
    top_p: Annotated[float | None, Field(gt=0.0, le=1.0)] = None
    seed: Annotated[int | None, Field(ge=0, le=2**64 - 1)] = None
    top_k: TopK = None

    def prompts(self) -> tuple[str | tuple[int, ...], ...]:
        """Each prompt, text or token ids (a chat's: one empty, its messages rendered later)."""
        return ("",)

    def logprobs_asked(self) -> int | None:
        """How many alternatives per token the request asked for, None for no log-probs."""
        return None

    def generated_max(self) -> int | None:
        """``max_tokens`` as asked, None for the endpoint's default."""
        return self.max_tokens


class InferenceRequest(_Sampled):
    """The deployment guide's ``/v1/inference``: greedy unless a temperature is given."""

    prompt: Annotated[str, Field(description="the prompt's text")]

    def prompts(self) -> tuple[str | tuple[int, ...], ...]:
        return (self.prompt,)


# OpenAI's fields this server honours only at their default: field -> (accepted values, why)
_ONLY_DEFAULT = {
    "best_of": ((1,), "best_of is not supported; send best_of 1"),
    "min_p": ((0, 0.0), "min_p is not supported by this engine's sampler; send min_p 0"),
    "suffix": (("",), "suffix (insertion) is not supported"),
    "logit_bias": ((), "logit_bias is not supported"),
    "tools": ((), "tool calls are not supported"),
    "tool_choice": (("none",), "tool calls are not supported"),
    "parallel_tool_calls": ((), "tool calls are not supported"),
    "functions": ((), "function calls are not supported"),
    "function_call": (("none",), "function calls are not supported"),
    "response_format": (({"type": "text"},), "only text responses are supported"),
}
_AtDefaults = create_model("_AtDefaults", __base__=_Sampled,  # type: ignore[call-overload]
                           **{name: (only_default(fine, why), None)
                              for name, (fine, why) in _ONLY_DEFAULT.items()})


class _OpenAIRequest(_AtDefaults):
    """What both of OpenAI's endpoints take (``_ONLY_DEFAULT``'s fields at their default),
    with vLLM's and trtllm-serve's extensions as they take them in the body."""

    ENGINE_BOUNDED = {**_Sampled.ENGINE_BOUNDED, "min_tokens": min_tokens_field}

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    user: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    ignore_eos: bool = False     # max_tokens tokens, always
    min_tokens: MinTokens = None
    repetition_penalty: Annotated[float | None, Field(gt=0.0, le=2.0)] = None
    cache_salt: Annotated[str | None, Field(min_length=1, max_length=MAX_CACHE_SALT,
                                            description="vLLM's: a cached prefix is shared "
                                                        "only among requests of one salt")] = None
    return_tokens_as_token_ids: bool = False    # vLLM's: log-probs name tokens "token_id:N"

    @model_validator(mode="after")
    def _choices_fit(self) -> "_OpenAIRequest":
        if self.stream_options is not None and not self.stream:
            raise refused("stream_options", "only allowed with stream true")
        prompts = len(self.prompts())
        if prompts * self.n > MAX_CHOICES:
            raise refused("n", f"{prompts} prompts x n {self.n} is more than {MAX_CHOICES} "
                               f"choices per request")
        if prompts * self.n > 1 and self.stream:
            raise refused("stream", "one choice per streamed request (one prompt, n 1); send "
                                    "stream false for several")
        return self


class CompletionRequest(_OpenAIRequest):
    """OpenAI's ``/v1/completions``; ``echo`` with ``logprobs`` also asks for the prompt's
    log-probs (lm-eval's loglikelihood requests)."""

    ENGINE_BOUNDED = {**_OpenAIRequest.ENGINE_BOUNDED, "prompt": prompt_field}

    prompt: Prompt
    echo: bool = False
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)] = None

    def prompts(self) -> tuple[str | tuple[int, ...], ...]:
        several = isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list))
        return tuple(p if isinstance(p, str) else tuple(p)
                     for p in (self.prompt if several else [self.prompt]))

    def logprobs_asked(self) -> int | None:
        return self.logprobs


class ChatRequest(_OpenAIRequest):
    """OpenAI's ``/v1/chat/completions``: text messages; ``max_completion_tokens`` wins over
    ``max_tokens``; ``top_logprobs`` only with ``logprobs`` true (OpenAI's rule)."""

    ENGINE_BOUNDED = {**_OpenAIRequest.ENGINE_BOUNDED, "messages": messages_field,
                      "max_completion_tokens": max_tokens_field}

    messages: Messages
    max_completion_tokens: MaxTokens = None
    logprobs: bool = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self) -> "ChatRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise refused("top_logprobs", "only allowed with logprobs true")
        return self

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def generated_max(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


ENDPOINTS: dict[str, type[_Sampled]] = {
    "completions": CompletionRequest, "chat": ChatRequest, "inference": InferenceRequest}


@functools.lru_cache(maxsize=16)
def request_model(endpoint: str, limits: EngineLimits = _ANY_ENGINE) -> type[_Sampled]:
    """``endpoint``'s model ("completions", "chat", "inference") with ``limits``' bounds."""
    base = ENDPOINTS[endpoint]
    if limits == _ANY_ENGINE:
        return base
    bounded = {name: (bound(limits), ... if base.model_fields[name].is_required()
                      else base.model_fields[name].default)
               for name, bound in base.ENGINE_BOUNDED.items()}
    return create_model(base.__name__, __base__=base, **bounded)  # type: ignore[call-overload]

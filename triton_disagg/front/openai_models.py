"""The HTTP front's request bodies as pydantic models: OpenAI's ``/v1/completions``
(:class:`CompletionRequest`) and ``/v1/chat/completions`` (:class:`ChatRequest`), the
deployment guide's ``/v1/inference`` (:class:`InferenceRequest`); with the served engine's
bounds, :func:`request_model`. The same models give the OpenAPI document's body schemas
(:mod:`.openapi`), so the document and the checks cannot drift apart.

Invariants: every field is one of :mod:`.openai_fields`' (known, of its JSON type, bounded
before it is used; ``null`` as if not sent). A field OpenAI defines that this server cannot
honour (``best_of``, tools, ``min_p``, ...) validates only at its default
(:func:`~.openai_fields.only_default`); ``stop`` is at most ``MAX_STOP_WORDS`` words of at
most ``MAX_STOP_CHARS`` characters, prompts x ``n`` at most ``MAX_CHOICES``, ``cache_salt``
at most ``MAX_CACHE_SALT`` characters. A rule between fields fails as a ``refused`` error
whose ``ctx["param"]`` names the field (:func:`~.openai_fields.refused`).
"""

import functools
from typing import Annotated, Any, Callable, ClassVar

from pydantic import Field, Tag, create_model, model_validator

from triton_disagg.engine.sampling import MAX_CACHE_SALT
from triton_disagg.front.openai_fields import (MAX_CHOICES, EngineLimits, StrictModel, by_form,
                                               max_tokens_field, messages_field,
                                               min_tokens_field, only_default, prompt_field,
                                               refused, top_k_field)

COMPLETION_MAX_TOKENS = 16      # OpenAI's default for /v1/completions
MAX_LOGPROBS = 5                # OpenAI's limit on completions' ``logprobs``
MAX_TOP_LOGPROBS = 20           # OpenAI's limit on chat's ``top_logprobs``
MAX_STOP_WORDS = 4              # OpenAI's limit on ``stop``
MAX_STOP_CHARS = 256            # per stop sequence


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

    # the fields whose bounds are the served engine's (:func:`request_model` narrows them)
    ENGINE_BOUNDED: ClassVar[tuple[str, ...]] = ("max_tokens", "top_k")
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

    ENGINE_BOUNDED = (*_Sampled.ENGINE_BOUNDED, "min_tokens")

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

    ENGINE_BOUNDED = (*_OpenAIRequest.ENGINE_BOUNDED, "prompt")

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

    ENGINE_BOUNDED = (*_OpenAIRequest.ENGINE_BOUNDED, "messages", "max_completion_tokens")

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
# an ENGINE_BOUNDED field -> its type for an engine's limits (the classes declare any engine's)
_FIELD_TYPES: dict[str, Callable[[EngineLimits], Any]] = {
    "max_tokens": max_tokens_field, "max_completion_tokens": max_tokens_field,
    "min_tokens": min_tokens_field, "top_k": top_k_field, "prompt": prompt_field,
    "messages": messages_field}


@functools.lru_cache(maxsize=16)
def request_model(endpoint: str, limits: EngineLimits = _ANY_ENGINE) -> type[_Sampled]:
    """``endpoint``'s model ("completions", "chat", "inference") with ``limits``' bounds."""
    base = ENDPOINTS[endpoint]
    if limits == _ANY_ENGINE:
        return base
    bounded = {name: (_FIELD_TYPES[name](limits), ... if base.model_fields[name].is_required()
                      else base.model_fields[name].default) for name in base.ENGINE_BOUNDED}
    return create_model(base.__name__, __base__=base, **bounded)  # type: ignore[call-overload]

"""vLLM's tokenizer routes on the front: ``GET /tokenizer_info``, ``POST /tokenize`` and
``POST /detokenize``, the three lm-eval's ``local-completions`` probes (its
``tokenizer_backend=auto``) to tokenize on the server instead of loading the tokenizer itself.

Shapes are vLLM's (``vllm/entrypoints/serve/tokenize``): ``/tokenizer_info`` answers the
tokenizer's configuration (vLLM's ``TokenizerInfoResponse``: ``tokenizer_config.json``'s
fields, ``tokenizer_class``, ``chat_template``); ``/tokenize`` takes ``{"prompt",
"add_special_tokens"}`` and answers ``{"count", "max_model_len", "tokens", "token_strs"}``;
``/detokenize`` takes ``{"tokens"}`` and answers ``{"prompt"}``; each takes an optional
``model``, which must be the served one (else 404).

Invariants: ``/tokenizer_info`` answers only :data:`INFO_FIELDS` of the engine's
``tokenizer_config.json`` (special tokens as their text, never a file path or any other
key), the class, and the chat template the front renders, built once at start; a prompt is
tokenized as a completion's is (:class:`~triton_disagg.front.tokenizer.Tokenizer`, Hugging
Face's ``tokenizer(prompt)``), at most the front's character bound of a prompt
(``RequestEncoder.max_prompt_chars``), off the event loop (on a worker thread that lets go
of the GIL while it tokenizes: :meth:`~triton_disagg.front.tokenizer.Tokenizer.encode`); ``tokens`` to decode are at most
``max_seq_len`` ids of the vocabulary, counted before they are looked at.
"""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path
from typing import Any, Callable
# Any here: JSON values of tokenizer_config.json and of request bodies.

from aiohttp import web
from pydantic import BaseModel, Field, ValidationError, create_model

from triton_disagg.front.chat_template import TOKENIZER_CONFIG, ChatTemplate, special_tokens
from triton_disagg.front.field_checks import shown
from triton_disagg.front.generation_routes import FRONT, PREPARER, send_whole
from triton_disagg.front.openai_api import ApiError, read_json
from triton_disagg.front.openai_models import StrictModel, token_ids
from triton_disagg.front.orchestrator_call import RequestEncoder

# tokenizer_config.json's fields /tokenizer_info answers (besides the special tokens' text)
INFO_FIELDS = ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces",
               "tokenizer_class")
DEFAULT_CLASS = "PreTrainedTokenizerFast"     # what transformers loads a tokenizer.json as


def tokenizer_info(engine_dir: str | Path, chat: ChatTemplate | None,
                   max_seq_len: int) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info`` for the engine: :data:`INFO_FIELDS` of its tokenizer config
    (each of its JSON scalar type), its special tokens' text, ``model_max_length`` the engine's
    ``max_seq_len``, and ``chat_template`` where it has one."""
    path = Path(engine_dir) / TOKENIZER_CONFIG
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    info: dict[str, Any] = {k: config[k] for k in INFO_FIELDS
                            if isinstance(config.get(k), (bool, str))}
    info.setdefault("tokenizer_class", DEFAULT_CLASS)
    info.update(special_tokens(config), model_max_length=max_seq_len)
    if chat is not None:
        info["chat_template"] = chat.source
    return info


class TokenizeRequest(StrictModel):
    """vLLM's completion form of ``/tokenize`` (its chat form, ``messages``, is not served);
    unbounded here: the routes validate with :func:`tokenizer_posts`' bounded models."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None      # absent or null: True, as vLLM's default


class DetokenizeRequest(StrictModel):
    """vLLM's ``/detokenize``; bounded as :class:`TokenizeRequest` is."""

    model: str | None = None
    tokens: list[int]


def _checked(model: type[BaseModel], preparer: RequestEncoder, body: Any) -> Any:
    """``body`` validated by ``model``, or the 400 naming its first wrong field; the model
    named must be the served one (404)."""
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)      # an unknown field first: it says most
        error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        where = ".".join(str(p) for p in error["loc"])
        param = next((p for p in error["loc"] if isinstance(p, str)), None)
        raise ApiError(f"{shown(where) if where else 'the body'}: {error['msg']}",
                       param=param) from None
    if request.model is not None and request.model != preparer.model:
        raise ApiError(f"model {shown(request.model)} not found; this server serves "
                       f"'{preparer.model}' (GET /v1/models)", status=404, param="model",
                       kind="not_found_error")
    return request


async def _body(request: web.Request, model: type[BaseModel]) -> Any:
    return await read_json(request, request.app[FRONT].body_timeout_seconds,
                           functools.partial(_checked, model, request.app[PREPARER]))


@functools.lru_cache(maxsize=4)     # per served engine: built once, not per /openapi.json
def tokenizer_posts(preparer: RequestEncoder) -> dict[str, tuple[str, type[BaseModel], str]]:
    """``/tokenize`` and ``/detokenize`` -> (operation id, body model with the served
    engine's bounds, summary), as :func:`~triton_disagg.front.openapi.document` takes them: a
    prompt of at most its character bound, at most ``max_seq_len`` ids of its vocabulary."""
    prompt = (str, Field(max_length=preparer.max_prompt_chars))
    tokens = (token_ids(preparer.limits, min_length=0), ...)
    return {"/tokenize": ("tokenize", create_model("TokenizeRequest", __base__=TokenizeRequest,
                                                   prompt=prompt),
                          "vLLM's: a prompt's token ids, as a completion's are counted"),
            "/detokenize": ("detokenize", create_model("DetokenizeRequest",
                                                       __base__=DetokenizeRequest,
                                                       tokens=tokens),
                            "vLLM's: token ids' text")}


def add_tokenizer_routes(app: web.Application, preparer: RequestEncoder) -> None:
    """The three routes on ``app`` (whose ``PREPARER`` and ``FRONT`` are set)."""
    info = tokenizer_info(preparer.engine_dir, preparer.chat, preparer.max_seq_len)
    posts = tokenizer_posts(preparer)
    tokenize_model, detokenize_model = posts["/tokenize"][1], posts["/detokenize"][1]

    async def get_info(request: web.Request) -> web.StreamResponse:
        return await send_whole(request, info, {})

    async def tokenize(request: web.Request) -> web.StreamResponse:
        body = await _body(request, tokenize_model)
        ids = await _off_loop(preparer.tokenizer.encode, body.prompt,
                              body.add_special_tokens is not False)
        return await send_whole(request, {"count": len(ids), "max_model_len":
                                          preparer.max_seq_len, "tokens": ids,
                                          "token_strs": None}, {})

    async def detokenize(request: web.Request) -> web.StreamResponse:
        body = await _body(request, detokenize_model)
        text = await _off_loop(preparer.tokenizer.decode, body.tokens, False)
        return await send_whole(request, {"prompt": text}, {})

    app.router.add_get("/tokenizer_info", get_info)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)


async def _off_loop(call: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, call, *args)

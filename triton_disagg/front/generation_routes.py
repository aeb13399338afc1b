"""The front's generation routes, ``POST /v1/completions``, ``/v1/chat/completions`` and
``/v1/inference``, and the answers they write: OpenAI's completion and chat objects (whole,
or as SSE chunks), the guide's ``/v1/inference`` JSON, usage, finish reasons and log-probs
(:mod:`.http_front` builds the app around the routes and states the invariants every route
keeps).

A request is parsed (:mod:`.openai_api`), counted once per choice against the front's cap
(:mod:`.http_gates`), prepared per choice and sent to the orchestrator
(:class:`~.orchestrator_call.RequestEncoder`, :class:`~.orchestrator_call.Relay`): one
choice streamed as SSE or answered whole, several answered whole, in OpenAI's order of
``index``; a server fault is answered by :func:`server_error`. Every route's errors (the
app's middleware :func:`openai_errors`) are OpenAI's error JSON.

Invariants of an answer: streamed content concatenates to the non-streamed content; the
text ends before the first stop sequence in it, which is left out (OpenAI's semantics; the
engine keeps a stop word, as TensorRT-LLM does, and matches it on tokens:
:class:`StopTrimmer` matches on text); ``finish_reason`` is ``"stop"`` when a stop sequence
cut the text, else the orchestrator's reason in OpenAI's words (:func:`finish_reason`),
never worked out from token counts, and a stream that ended without that reason is an error,
never a short text passed off as whole; a chunk of a stream whose client asked for
``include_usage`` carries ``"usage": null`` but the last. Log-probs (:class:`Logprobs`) are
OpenAI's objects for the tokens the engine chose, the raw model's (before temperature and
penalties, as vLLM's default; :mod:`~triton_disagg.engine.logprobs`): completions'
``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``, where a ``top_logprobs``
entry maps the chosen token's text and those of the N most likely tokens (``logprobs`` N) to
their log-probs (so up to N + 1 entries, as OpenAI and vLLM); chat's ``content``, where each
entry's ``top_logprobs`` lists the N most likely tokens (``top_logprobs`` N), most likely
first, as ``{token, logprob, bytes}``. An echoed prompt's tokens come first (``echo`` with
``logprobs``: :meth:`Logprobs.prompt`), with the prompt's own log-probs and real
alternatives, as vLLM's ``prompt_logprobs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Sequence

from aiohttp import web

from triton_disagg.config.front_section import FrontConfig
from triton_disagg.engine.logprobs import TopLogprobs
from triton_disagg.engine.prompt_logprobs import PromptLogprobs
from triton_disagg.engine.sequence import TokenEvent
from triton_disagg.errors import HTTP_STATUS, ErrorCode
from triton_disagg.front.http_gates import RETRY_AFTER_SECONDS, RequestCount
from triton_disagg.front.openai_api import (MAX_BODY_BYTES, ApiError, Generation, parse,
                                           read_json)
from triton_disagg.front.orchestrator_call import OrchestratorError, Relay, RequestEncoder, \
    unreachable
from triton_disagg.protocol import FinishReason

REQUEST_ID = "X-Request-Id"
# The prompt's log-probs are made on these threads, not the loop's shared default executor:
# at most PROMPT_LOGPROBS_THREADS at once, so a burst (or clients that left: a queued one is
# dropped when its request is cancelled, a running one runs out) holds no more.
PROMPT_LOGPROBS_THREADS = 2
PROMPT_LOGPROBS = ThreadPoolExecutor(PROMPT_LOGPROBS_THREADS, thread_name_prefix="prompt-logprobs")
WHOLE_CHUNK = 64 * 2**10        # a whole answer's bytes per write (aiohttp drains past this)
log = logging.getLogger("triton_disagg.front")
# What a client reads of a server fault, by its code (the log has the cause).
_FAULTS = {ErrorCode.INTERNAL: "internal error",
           ErrorCode.UNAVAILABLE: "the service is unavailable now; retry later",
           ErrorCode.TIMEOUT: "the request timed out inside the server",
           ErrorCode.CANCELLED: "the request was cancelled inside the server"}

PREPARER, RELAY = web.AppKey("preparer", RequestEncoder), web.AppKey("relay", Relay)
CALLS = web.AppKey("calls", RequestCount)
FRONT = web.AppKey("front", FrontConfig)
ID_KEY = web.RequestKey("request_id", str)


def request_id_of(request: web.Request) -> str:
    if ID_KEY not in request:
        request[ID_KEY] = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
    return request[ID_KEY]


def server_error(exc: Exception, request_id: str) -> ApiError:
    """What the client is answered for ``exc``, by its code (never its message): the
    request's own mistake (INVALID_ARG) as the orchestrator named it; a server fault as its
    kind and the request id, the cause logged under that id (UNAVAILABLE with
    ``Retry-After``)."""
    if isinstance(exc, OrchestratorError):
        code = exc.code
        if code is ErrorCode.INVALID_ARG:
            return ApiError(str(exc), HTTP_STATUS[code])
        log.warning("request %s: %s: %s", request_id, code, exc)
    elif unreachable(exc):
        code = ErrorCode.UNAVAILABLE
        log.warning("request %s: tritonserver did not answer: %s: %s", request_id,
                    type(exc).__name__, exc)
    else:
        code = ErrorCode.INTERNAL
        log.error("request %s: internal error", request_id, exc_info=exc)
    retry = ({"Retry-After": str(RETRY_AFTER_SECONDS)} if code is ErrorCode.UNAVAILABLE
             else None)
    return ApiError(f"{_FAULTS[code]} (request id {request_id})", HTTP_STATUS[code],
                    kind="server_error", headers=retry)


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Every error as OpenAI's error JSON: aiohttp's own (404 path, 405, 413) included."""
    try:
        return await handler(request)
    except ApiError as exc:
        return _error(exc, request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        reason = (f"the body is over {MAX_BODY_BYTES} bytes" if exc.status == 413
                  else f"{exc.reason}: {request.method} {request.path[:100]}")
        return _error(ApiError(reason, exc.status, kind=kind), request)
    except ConnectionError:
        raise                       # the client is gone: nothing to answer
    except Exception as exc:  # noqa: BLE001 - a fault of this process: logged, not echoed
        return _error(server_error(exc, request_id_of(request)), request)


def _error(exc: ApiError, request: web.Request) -> web.Response:
    if exc.status >= 500:
        log.warning("request %s: %s %s", request_id_of(request), exc.status, exc)
    return web.json_response(exc.body(), status=exc.status,
                             headers={**exc.headers, REQUEST_ID: request_id_of(request)})


async def _generate(request: web.Request, endpoint: str) -> web.StreamResponse:
    preparer = request.app[PREPARER]
    gen = await read_json(request, request.app[FRONT].body_timeout_seconds,
                          functools.partial(parse, endpoint, limits=preparer.limits))
    choices = gen.choices()
    with request.app[CALLS].more(len(choices) - 1):   # a call per choice, each counted
        return await _generate_choices(request, gen, choices)


async def _generate_choices(request: web.Request, gen: Generation,
                            choices: list[Generation]) -> web.StreamResponse:
    preparer, relay = request.app[PREPARER], request.app[RELAY]
    loop, request_id = asyncio.get_running_loop(), request_id_of(request)
    inputs = [await loop.run_in_executor(None, preparer.inputs, c) for c in choices]
    answers = [_Answer(preparer, c, i) for c, i in zip(choices, inputs)]
    headers = {REQUEST_ID: request_id}
    if gen.stream:          # one choice (parse refuses several streamed)
        async with _opened(relay, inputs[0], request_id, request_id) as deltas:
            return await _stream(request, answers[0], OpenAIObjects(gen, preparer.model), deltas,
                                 headers)
    # Triton request ids: the client's for one choice, with the choice's index for several
    call_ids = [request_id] if len(choices) == 1 else \
        [f"{request_id}-{i}" for i in range(len(choices))]
    tasks = [asyncio.ensure_future(_collect(relay, a, i, c, request_id))
             for a, i, c in zip(answers, inputs, call_ids)]
    try:
        done = await asyncio.gather(*tasks)
    finally:                # one failed (or the client left): the others stop too
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return await send_whole(request, _whole(gen, preparer.model, done), headers)


@contextlib.asynccontextmanager
async def _opened(relay: Relay, inputs: dict, call_id: str,
                  request_id: str) -> AsyncIterator[AsyncIterator[TokenEvent]]:
    """The orchestrator's deltas for ``inputs``, once the first came (an error before it is
    a plain HTTP error: no byte went out yet); leaving the block cancels the call."""
    async with contextlib.aclosing(relay.stream(inputs, call_id)) as deltas:
        try:
            first = await anext(deltas, None)
        except Exception as exc:  # noqa: BLE001 - before any byte went out: a plain HTTP error
            # A timeout stays 504 though the server that let it pass made this one not ready;
            # the request's own mistake stays 400.
            as_is = (isinstance(exc, OrchestratorError)
                     and exc.code in (ErrorCode.TIMEOUT, ErrorCode.INVALID_ARG))
            not_ready = None if as_is else await relay.ready()
            if not_ready is not None:          # the log keeps what failed first (not the client)
                log.warning("request %s: its call failed (%s: %s), then the server said it is "
                            "not ready", request_id, type(exc).__name__, exc)
                raise ApiError(f"not ready: {not_ready}", 503, kind="server_error") from None
            raise server_error(exc, request_id) from None
        yield _chain(first, deltas)


async def _chain(first: TokenEvent | None, deltas) -> AsyncIterator[TokenEvent]:
    if first is not None:
        yield first
    async for delta in deltas:
        yield delta


class _Answer:
    """One choice's answer as it is made: the text (stop sequences cut, the echoed prompt
    first), the last counts, the finish reason given, and the log-probs when asked for."""

    def __init__(self, preparer: RequestEncoder, gen: Generation, inputs: dict):
        self.gen = gen
        self.echo = preparer.prompt(gen) if gen.echo else ""
        self.logprobs = None if gen.logprobs is None else \
            Logprobs(gen, token_id_name if gen.tokens_as_ids else preparer.token_text,
                     len(self.echo))
        self.prompt_ids = inputs["input_ids"].reshape(-1).tolist()     # [1, n] -> [n]
        self.trimmer, self.last = StopTrimmer(gen.stop), TokenEvent("", [])

    def add(self, delta: TokenEvent) -> tuple[str, dict | None]:
        """The text safe to send now and the log-probs of ``delta``'s tokens (None unless
        asked for), after the echoed prompt's when ``delta`` brings them (the first)."""
        self.last = delta
        text = self.trimmer.add(delta.text)
        if self.logprobs is None:
            return text, None
        tokens = self.logprobs.of(delta.tokens, delta.log_probs or (), delta.top or ())
        if delta.prompt_logprobs is None:
            return text, tokens
        prompt = self.logprobs.prompt(self.prompt_ids, delta.prompt_logprobs)
        return text, merge_logprobs([prompt, tokens], chat=False)

    def finish(self) -> tuple[str, str]:
        """The text left to send and the finish reason; :class:`OrchestratorError` when the
        orchestrator's stream ended without its final answer (no finish reason) and no stop
        sequence cut it here: a short text is never passed off as a whole one."""
        if self.last.finish_reason is None and not self.trimmer.stopped:
            raise OrchestratorError("the orchestrator's stream ended without its final answer",
                                    ErrorCode.INTERNAL)
        return self.trimmer.finish(), finish_reason(self.trimmer, self.last.finish_reason)


def token_id_name(token_id: int) -> str:
    """vLLM's name of a token in log-probs with ``return_tokens_as_token_ids``."""
    return f"token_id:{token_id}"


async def _added(answer: _Answer, delta: TokenEvent) -> tuple[str, dict | None]:
    """``answer.add(delta)``, on ``PROMPT_LOGPROBS`` when ``delta`` brings the prompt's
    log-probs the answer shows (a token decode per prompt token and per alternative: seconds
    for a long prompt, which the loop's other clients would wait out)."""
    if delta.prompt_logprobs is None or answer.logprobs is None:
        return answer.add(delta)
    return await asyncio.get_running_loop().run_in_executor(PROMPT_LOGPROBS, answer.add, delta)


async def _collect(relay: Relay, answer: _Answer, inputs: dict, call_id: str,
                   request_id: str) -> tuple[_Answer, str, str, dict | None]:
    """One choice, whole: its answer, text, finish reason and log-probs."""
    async with _opened(relay, inputs, call_id, request_id) as deltas:
        text, parts = answer.echo, []
        try:
            async for delta in deltas:
                more, logprobs = await _added(answer, delta)
                text += more
                parts += [logprobs] if logprobs is not None else []
                if answer.trimmer.stopped:
                    break           # leaving the relay's stream cancels the request
        except Exception as exc:  # noqa: BLE001
            raise server_error(exc, request_id) from None
    tail, reason = answer.finish()
    logprobs = None if answer.logprobs is None else merge_logprobs(parts, answer.logprobs.chat)
    return answer, text + tail, reason, logprobs


def _whole(gen: Generation, model: str, done: list[tuple[_Answer, str, str, dict | None]]
           ) -> dict:
    """The non-streamed body of ``done`` choices (one for ``/v1/inference``); usage counts
    each prompt once and every choice's tokens."""
    prompt_tokens = sum(a.last.prompt_tokens for a, *_ in done[::gen.n])
    cached_tokens = sum(a.last.cached_tokens for a, *_ in done[::gen.n])
    completion_tokens = sum(a.last.completion_tokens for a, *_ in done)
    if gen.endpoint == "inference":
        _, text, reason, _ = done[0]
        body = {"id": uuid.uuid4().hex, "model": model, "text": text, "finish_reason": reason,
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
    else:
        reply = OpenAIObjects(gen, model)
        body = reply.whole([reply.choice(i, text, reason, logprobs)
                            for i, (_, text, reason, logprobs) in enumerate(done)],
                           prompt_tokens, completion_tokens, cached_tokens)
    return body


async def send_whole(request: web.Request, body: dict, headers: dict) -> web.StreamResponse:
    """``body`` as JSON (made off the loop: an answer with log-probs runs to megabytes),
    written ``WHOLE_CHUNK`` bytes at a time as a stream is (each write waits for the client
    to take in the last: a client that takes nothing more for ``write_timeout_seconds`` is
    dropped, :mod:`.http_gates`), so an answer nobody reads holds no connection (and no
    memory) for longer than that."""
    data = (await asyncio.get_running_loop().run_in_executor(
        None, functools.partial(json.dumps, body, ensure_ascii=False))).encode("utf-8")
    response = web.StreamResponse(headers={**headers,
                                           "Content-Type": "application/json; charset=utf-8"})
    response.content_length = len(data)
    await response.prepare(request)
    for start in range(0, len(data), WHOLE_CHUNK):
        await response.write(data[start:start + WHOLE_CHUNK])
    await response.write_eof()
    return response


async def _stream(request: web.Request, answer: _Answer, reply: OpenAIObjects,
                  deltas: AsyncIterator[TokenEvent], headers: dict) -> web.StreamResponse:
    response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})

    async def out(event: dict | str) -> None:
        await response.write(sse(event))   # waits while the client is behind (http_gates)

    await response.prepare(request)         # the status line and headers
    if reply.chat or answer.echo:
        await out(reply.chunk(answer.echo, first=True))
    try:
        async for delta in deltas:
            text, logprobs = await _added(answer, delta)
            if text or logprobs:
                await out(reply.chunk(text, logprobs=logprobs))
            if answer.trimmer.stopped:
                break               # leaving the relay's stream cancels the request
        tail, reason = answer.finish()
    except (ConnectionResetError, asyncio.CancelledError):
        raise                       # the client left: the relay's stream is cancelled
    except Exception as exc:  # noqa: BLE001 - the status line went out: an error event
        await out(server_error(exc, request_id_of(request)).body())
        return response
    await out(reply.chunk(tail, reason))
    if answer.gen.include_usage:
        await out(reply.usage_chunk(answer.last.prompt_tokens, answer.last.completion_tokens,
                                    answer.last.cached_tokens))
    await out("[DONE]")
    await response.write_eof()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def inference(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "inference")


# ---- the answers: OpenAI's objects, whole or as SSE chunks

# The orchestrator's finish reason in OpenAI's words; "abort": as vLLM says of a request the
# server stopped before it ended.
OPENAI_FINISH = {"stop": "stop", "stop_word": "stop", "length": "length", "cancelled": "abort"}
_OBJECTS = {"completions": ("cmpl", "text_completion", "text_completion"),
            "chat": ("chatcmpl", "chat.completion", "chat.completion.chunk")}


class StopTrimmer:
    """Text deltas in, text safe to send out. OpenAI's ``stop`` is matched on text, the
    engine's stop words on tokens (a word tokenized alone may not match the tokens it is
    part of mid-text), so the front matches the text itself: the text ends before the first
    stop sequence in it (``stopped`` set: the caller stops reading, which cancels the
    request), and the last ``longest - 1`` characters are held back until it is clear that
    they do not start one."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""          # everything received, cut at a stop sequence
        self.sent = 0           # characters of it already given out
        self.stopped = False    # a stop sequence ended the text

    def add(self, delta: str) -> str:
        if self.stopped:
            return ""
        self.text += delta
        start = max(0, self.sent - self.hold)
        found = [i for i in (self.text.find(w, start) for w in self.stop) if i >= 0]
        if found:
            self.text, self.stopped = self.text[:min(found)], True
            safe = len(self.text)
        else:
            safe = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def finish(self) -> str:
        """What is left to send once the text ended."""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def finish_reason(trimmer: StopTrimmer, given: FinishReason | None) -> str:
    """``"stop"`` when a stop sequence cut the text (``given`` may then be None: the stream
    was left before its end), else the orchestrator's ``given`` reason in OpenAI's words."""
    return "stop" if trimmer.stopped or given is None else OPENAI_FINISH[given]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: the prompt tokens served from the prefix
    cache (``prompt_tokens_details``, as OpenAI and vLLM report them)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Logprobs:
    """One choice's log-probs in OpenAI's form, the completion's text offsets starting at
    ``offset`` (the echoed prompt's length); ``token_text`` decodes one token id."""

    def __init__(self, gen: Generation, token_text: Callable[[int], str], offset: int = 0):
        self.chat, self.top = gen.endpoint == "chat", gen.logprobs or 0
        self.token_text, self.offset = token_text, offset

    def of(self, ids: Sequence[int], log_probs: Sequence[float],
           top: Sequence[TopLogprobs] = ()) -> dict:
        """The object for these tokens (the next ones of the choice), ``top`` their
        alternatives (one per token; none when the request asked for none)."""
        texts = [self.token_text(i) for i in ids]
        tops = list(top) if len(top) == len(ids) else [TopLogprobs([], [])] * len(ids)
        if self.chat:
            return {"content": [self._chat_entry(t, lp, alt)
                                for t, lp, alt in zip(texts, log_probs, tops)]}
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": texts, "token_logprobs": list(log_probs),
                "top_logprobs": [self._alternatives(t, lp, alt.ids, alt.logprobs)
                                 for t, lp, alt in zip(texts, log_probs, tops)],
                "text_offset": offsets}

    def prompt(self, ids: Sequence[int], logprobs: PromptLogprobs) -> dict:
        """The completions object of the echoed prompt's tokens ``ids`` (text offsets from 0):
        the first token has no log-prob (null, as OpenAI and vLLM say); each other's
        ``top_logprobs`` holds the prompt's own and the ``top`` most likely tokens there."""
        texts = [self.token_text(i) for i in ids]
        offsets = [0]
        for text in texts[:-1]:
            offsets.append(offsets[-1] + len(text))
        top: list[dict | None] = [None]
        for text, chosen, alt_ids, alt in zip(texts[1:], logprobs.chosen.tolist(),
                                              logprobs.top_ids.tolist(), logprobs.top.tolist()):
            top.append(self._alternatives(text, chosen, alt_ids, alt))
        return {"tokens": texts, "token_logprobs": [None] + logprobs.chosen.tolist(),
                "top_logprobs": top, "text_offset": offsets}

    def _alternatives(self, text: str, log_prob: float, alt_ids: Sequence[int],
                      alt: Sequence[float]) -> dict:
        """A completions ``top_logprobs`` entry: the chosen token's text and its first
        ``top`` alternatives' -> log-prob. Where ids share a text, it maps to the most
        likely one's log-prob, so the entry's largest value stays the most likely token's."""
        entry = {text: log_prob}
        for i, lp in zip(alt_ids[:self.top], alt[:self.top]):
            name = self.token_text(i)
            entry[name] = max(lp, entry.get(name, lp))
        return entry

    def _chat_entry(self, text: str, log_prob: float, alt: TopLogprobs) -> dict:
        """A chat ``content`` entry; its ``top_logprobs``: the first ``top`` alternatives."""
        entry = _chat_token(text, log_prob)
        entry["top_logprobs"] = [_chat_token(self.token_text(i), lp) for i, lp in
                                 zip(alt.ids[:self.top], alt.logprobs[:self.top])]
        return entry


def _chat_token(text: str, log_prob: float) -> dict:
    return {"token": text, "logprob": log_prob, "bytes": list(text.encode("utf-8"))}


def merge_logprobs(parts: list[dict], chat: bool) -> dict:
    """Consecutive :meth:`Logprobs.of` objects of one choice as one."""
    if chat:
        return {"content": [entry for part in parts for entry in part["content"]]}
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {key: [item for part in parts for item in part[key]] for key in keys}


class OpenAIObjects:
    """One request's OpenAI objects: an id and creation time shared by all its chunks."""

    def __init__(self, gen: Generation, model: str):
        prefix, self.whole_object, self.chunk_object = _OBJECTS[gen.endpoint]
        self.chat = gen.endpoint == "chat"
        self.usage_null = gen.stream and gen.include_usage
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def choice(self, index: int, text: str, reason: str, logprobs: dict | None = None) -> dict:
        """One choice of the whole (non-streamed) object."""
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "finish_reason": reason, "logprobs": logprobs}
        return {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}

    def whole(self, choices: list[dict], prompt_tokens: int, completion_tokens: int,
              cached_tokens: int = 0) -> dict:
        out = self._envelope(self.whole_object, choices)
        out["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return out

    def chunk(self, text: str, reason: str | None = None, first: bool = False,
              logprobs: dict | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta if text or first else {},
                      "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
        out = self._envelope(self.chunk_object, [choice])
        if self.usage_null:
            out["usage"] = None         # OpenAI's: only the last chunk has the usage
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int = 0) -> dict:
        """``stream_options.include_usage``: the last chunk, no choices, the usage."""
        out = self._envelope(self.chunk_object, [])
        out["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return out


def sse(payload: dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or ``data: [DONE]``) and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode("utf-8")

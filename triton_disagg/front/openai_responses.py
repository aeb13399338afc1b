"""What the HTTP front answers: OpenAI's completion and chat objects (whole, or as SSE
chunks), the guide's ``/v1/inference`` JSON, usage and finish reasons.

Invariants: streamed content concatenates to the non-streamed content; the text ends
before the first stop sequence in it, which is left out (OpenAI's semantics; the engine
keeps a stop word, as TensorRT-LLM does, and matches it on tokens: :class:`StopTrimmer`
matches on text); ``finish_reason`` is ``"stop"`` when a stop sequence cut the text, else
the orchestrator's reason in OpenAI's words (:func:`finish_reason`), never worked out
from token counts; a chunk of a stream whose
client asked for ``include_usage`` carries ``"usage": null`` but the last. Log-probs
(:class:`Logprobs`) are OpenAI's objects for the tokens the engine chose, the raw model's
(before temperature and penalties, as vLLM's default; :mod:`~triton_disagg.engine.logprobs`):
completions' ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``, where a
``top_logprobs`` entry maps the chosen token's text and those of the N most likely tokens
(``logprobs`` N) to their log-probs (so up to N + 1 entries, as OpenAI and vLLM); chat's
``content``, where each entry's ``top_logprobs`` lists the N most likely tokens
(``top_logprobs`` N), most likely first, as ``{token, logprob, bytes}``.
An echoed prompt's tokens come first (``echo`` with ``logprobs``: :meth:`Logprobs.prompt`),
with the prompt's own log-probs and real alternatives, as vLLM's ``prompt_logprobs``.
"""

from __future__ import annotations

import json
import time
import uuid

from typing import Callable, Sequence

from triton_disagg.engine.logprobs import TopLogprobs
from triton_disagg.engine.prompt_logprobs import PromptLogprobs
from triton_disagg.front.openai_api import Generation
from triton_disagg.protocol import FinishReason

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

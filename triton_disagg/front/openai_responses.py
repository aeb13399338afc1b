"""What the HTTP front answers: OpenAI's completion and chat objects (whole, or as SSE
chunks), the guide's ``/v1/inference`` JSON, usage and finish reasons.

Invariants: streamed content concatenates to the non-streamed content; the text ends
before the first stop sequence in it, which is left out (OpenAI's semantics; the engine
keeps a stop word, as TensorRT-LLM does, and matches it on tokens: :class:`StopTrimmer`
matches on text); ``finish_reason`` is ``"stop"`` when a stop sequence or the end
token ended the text, ``"length"`` when ``max_tokens`` did.
"""

from __future__ import annotations

import json
import time
import uuid

from triton_disagg.front.openai_api import Generation

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


def finish_reason(trimmer: StopTrimmer, completion_tokens: int, max_tokens: int) -> str:
    return "stop" if trimmer.stopped or completion_tokens < max_tokens else "length"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Reply:
    """One request's OpenAI objects: an id and creation time shared by all its chunks."""

    def __init__(self, gen: Generation, model: str):
        prefix, self.whole_object, self.chunk_object = _OBJECTS[gen.endpoint]
        self.chat = gen.endpoint == "chat"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def whole(self, text: str, reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        out = self._envelope(self.whole_object, [choice])
        out["usage"] = usage(prompt_tokens, completion_tokens)
        return out

    def chunk(self, text: str, reason: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta if text or first else {},
                      "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return self._envelope(self.chunk_object, [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """``stream_options.include_usage``: the last chunk, no choices, the usage."""
        out = self._envelope(self.chunk_object, [])
        out["usage"] = usage(prompt_tokens, completion_tokens)
        return out


def sse(payload: dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or ``data: [DONE]``) and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode("utf-8")

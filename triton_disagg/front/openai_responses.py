"""What the HTTP front answers: OpenAI's completion and chat objects (whole, or as SSE
chunks), the guide's ``/v1/inference`` JSON, usage and finish reasons.

Invariants: streamed content concatenates to the non-streamed content; a stop sequence
that ended the text is not in it (OpenAI's semantics; the engine keeps it, as TensorRT-LLM
does: :class:`StopTrimmer` holds back as many characters as the longest stop sequence
could need until the end); ``finish_reason`` is ``"stop"`` when a stop sequence or the end
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
    """Text deltas in, text safe to send out: never the start of a stop sequence that may
    turn out to end the text."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=0)
        self.text = ""          # everything received
        self.sent = 0           # characters of it already given out
        self.stopped = False    # the text ended with a stop sequence (set by finish)

    def add(self, delta: str) -> str:
        self.text += delta
        safe = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def finish(self) -> str:
        """The rest of the text, less the stop sequence that ends it (if one does)."""
        end = len(self.text)
        for word in self.stop:
            if self.text.endswith(word):
                end, self.stopped = end - len(word), True
                break
        out, self.sent = self.text[self.sent:max(end, self.sent)], len(self.text)
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

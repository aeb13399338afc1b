"""A checked :class:`~triton_disagg.front.openai_api.Generation` -> the orchestrator model's
input tensors, through the ``preprocessing`` model's own library (:mod:`.preprocess`), so
the HTTP front tokenizes, bounds and defaults a prompt exactly as the ensemble does.

Invariants: the model named must be the one served (else 404); a text prompt's ids are
Hugging Face's ``tokenizer(prompt)`` (a BOS when the tokenizer's configuration adds one:
:mod:`~triton_disagg.engine.tokenizer`); a chat's prompt is its messages rendered by the
engine's chat template (:mod:`.chat_template`), tokenized without added special tokens (the
template writes its own, as vLLM tokenizes it); the tensors carry
``stream`` true whatever the client asked (the front relays deltas, and a non-streamed
answer is their concatenation, which the orchestrator guarantees equal to its non-streamed
text) and ``arrival_ns`` (the orchestrator's time to first token starts here); a prompt
surely longer than the engine's context is refused before it is tokenized (chat's default
``max_tokens``, the rest of the context, needs its length: it is bounded first too); a
prompt of token ids (checked against the vocabulary by :mod:`.openai_api`) goes to the
engine as sent, bounded like a tokenized one; ``return_log_probs`` is set when the client
asked for ``logprobs``, ``top_logprobs`` when it asked for alternatives (completions'
``logprobs`` N, chat's ``top_logprobs`` N > 0), and ``prompt_logprobs`` when it echoes the
prompt with them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
# Any here: tensor dict values (numpy arrays and scalars of any dtype).

import numpy as np

from triton_disagg import peers, protocol as P
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.engine.tokenizer import Tokenizer
from triton_disagg.errors import RequestError
from triton_disagg.front.chat_template import ChatTemplate
from triton_disagg.front.openai_api import ApiError, Generation
from triton_disagg.front.openai_fields import EngineLimits, shown
from triton_disagg.front.openai_models import COMPLETION_MAX_TOKENS
from triton_disagg.engine.sampling import to_wire
from triton_disagg.front.preprocess import Preprocessor

_SPECS = P.by_name(P.ORCHESTRATOR_INPUTS)
# A prompt of more characters than max_seq_len x this is refused untokenized whatever the
# tokenizer (no tokenizer spends more on a token of text; with a length bound on the
# tokenizer, :meth:`Tokenizer.surely_more_tokens`, its longest entry counts if larger).
MAX_CHARS_PER_TOKEN = 64


class RequestEncoder:
    """Encodes an OpenAI request into the orchestrator's input tensors with one engine's
    tokenizer, limits and chat template; ``model``: the name served."""

    def __init__(self, engine_dir: str | Path, model: str):
        spec = EngineSpec.load(engine_dir)
        self.engine_dir = Path(engine_dir)
        self.tokenizer = Tokenizer(engine_dir)
        self.max_seq_len = spec.max_seq_len
        self.pre = Preprocessor(self.tokenizer, spec.max_seq_len, spec.eos_token_id,
                                spec.pad_token_id, peers.seal_key())
        self.chat = ChatTemplate.load(engine_dir)
        self.model = model
        # ids the tokenizer knows and the model has rows for (a tokenizer may add tokens past them)
        self.limits = EngineLimits(spec.max_seq_len,
                                   min(self.tokenizer.vocab_size, spec.shape.vocab_size))
        self.max_prompt_chars = spec.max_seq_len * max(MAX_CHARS_PER_TOKEN,
                                                       self.tokenizer.max_token_bytes or 0)

    def prompt(self, gen: Generation) -> str:
        """The prompt text: as sent (token ids decoded), or the chat's messages rendered."""
        if isinstance(gen.prompt, tuple):
            return self.tokenizer.decode(gen.prompt, skip_special_tokens=False)
        if gen.endpoint != "chat":
            return gen.prompt
        if self.chat is None:
            raise ApiError(f"model '{self.model}' has no chat template (tokenizer_config.json "
                           f"chat_template); use /v1/completions")
        return self.chat.render(list(gen.messages))

    def token_text(self, token_id: int) -> str:
        """One token's text, as log-probs name it (special tokens included)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def inputs(self, gen: Generation) -> dict[str, np.ndarray]:
        """The orchestrator's input arrays (each ``[1, ...]``: batch of one); raises
        :class:`ApiError` for a model not served or a prompt the engine refuses."""
        if gen.model is not None and gen.model != self.model:
            raise ApiError(f"model {shown(gen.model)} not found; this server serves "
                           f"'{self.model}' (GET /v1/models)", status=404, param="model",
                           kind="not_found_error")
        try:
            if isinstance(gen.prompt, tuple):
                arrays: dict[str, Any] = self._token_ids(gen)
            else:
                arrays = self._text(gen)
        except RequestError as exc:
            raise ApiError(str(exc), param="messages" if gen.endpoint == "chat"
                           else "prompt") from None
        arrays.update(gen.sampling)
        if gen.logprobs is not None:
            arrays["return_log_probs"] = True
        if gen.logprobs:                        # alternatives per generated token
            arrays["top_logprobs"] = gen.logprobs
        if gen.prompt_logprobs is not None:     # at least one alternative (no empty tensors)
            arrays["prompt_logprobs"] = max(1, gen.prompt_logprobs)
        arrays["stream"] = True
        arrays[P.ARRIVAL] = time.monotonic_ns()
        return {name: _batch_of_one(value, _SPECS[name].numpy_dtype)
                for name, value in arrays.items()}

    def _text(self, gen: Generation) -> dict[str, Any]:
        """A text prompt (or chat) through the preprocessing library."""
        self._check_chars(sum(len(m["content"]) for m in gen.messages))  # before rendering
        prompt = self.prompt(gen)
        self._check_chars(len(prompt))
        max_tokens = gen.max_tokens or self._default_max_tokens(gen, prompt)
        ensemble = {"text_input": np.array([prompt.encode("utf-8")], dtype=object),
                    "max_tokens": np.array([max_tokens], dtype=np.int32),
                    "stop_words": np.array([w.encode("utf-8") for w in gen.stop], dtype=object)}
        if gen.ignore_eos:
            ensemble["end_id"] = np.array([-1], dtype=np.int32)    # no end token
        return self.pre.process(ensemble, add_special_tokens=gen.endpoint != "chat")

    def _token_ids(self, gen: Generation) -> dict[str, Any]:
        """A prompt of token ids, as the preprocessing library would have tokenized it."""
        assert isinstance(gen.prompt, tuple)
        max_tokens = gen.max_tokens or COMPLETION_MAX_TOKENS
        if len(gen.prompt) + max_tokens > self.max_seq_len:
            raise RequestError(f"prompt ({len(gen.prompt)} tokens) + max_tokens ({max_tokens}) "
                               f"exceeds this engine's max_seq_len {self.max_seq_len}; shorten "
                               f"the prompt or lower max_tokens")
        stop = {"stop_words": np.array([w.encode("utf-8") for w in gen.stop], dtype=object)}
        return self.pre.sealed({
            "input_ids": np.array(gen.prompt, dtype=np.int32),
            "input_lengths": np.array([len(gen.prompt)], dtype=np.int32),
            "request_output_len": np.array([max_tokens], dtype=np.int32),
            "stop_words_list": to_wire(self.pre.word_ids(stop, "stop_words")),
            "bad_words_list": to_wire([]),
            "end_id": np.array([-1 if gen.ignore_eos else self.pre.eos_id], dtype=np.int32),
            "pad_id": np.array([self.pre.pad_id], dtype=np.int32)})

    def _check_chars(self, chars: int) -> None:
        if chars > self.max_prompt_chars:
            raise RequestError(f"the prompt has {chars} characters, more than this engine's "
                               f"max_seq_len of {self.max_seq_len} tokens can hold "
                               f"({self.max_prompt_chars}); shorten it")

    def _default_max_tokens(self, gen: Generation, prompt: str) -> int:
        """OpenAI's defaults: 16 for a completion; the rest of the context for chat."""
        if gen.endpoint != "chat":
            return COMPLETION_MAX_TOKENS
        room = self.max_seq_len - 1                   # at least one token generated
        if self.tokenizer.surely_more_tokens(prompt, room):
            raise ApiError(f"the prompt (more than {room} tokens) leaves no room to generate "
                           f"in this engine's max_seq_len {self.max_seq_len}; shorten the "
                           f"messages", param="messages")
        return max(1, self.max_seq_len - len(self.tokenizer.encode(prompt, False)))


def _batch_of_one(value: Any, dtype: type) -> np.ndarray:
    """A tensor as the orchestrator takes it: its dims with a batch axis of 1 in front."""
    array = np.asarray(value, dtype=dtype)
    if array.ndim == 0:
        array = array.reshape(1)        # scalar -> [1]
    return array[None]                  # [...] -> [1, ...]

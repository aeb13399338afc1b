"""The ``preprocessing`` model's logic: text -> ``input_ids``, words -> id lists, defaults.

Invariants: a request it accepts fits the engine (prompt + ``max_tokens`` <=
``max_seq_len``, at least one prompt token, ``max_tokens`` >= 1); an input the
serving stack cannot honour (beam search, several sequences, LoRA, prompt
tables, guided decoding, logits outputs) raises :class:`RequestError` naming
it, never silence.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from triton_disagg.serving.tensors import RequestError, scalar

# input -> (value that is fine, why another value is refused)
_REFUSED_UNLESS = {
    "beam_width": (1, "beam search is not supported; send beam_width 1"),
    "num_return_sequences": (1, "one sequence per request; send num_return_sequences 1"),
    "return_context_logits": (False, "context logits are not returned by this server"),
    "return_generation_logits": (False, "generation logits are not returned by this server"),
}
_REFUSED_IF_PRESENT = {
    "lora_task_id": "LoRA adapters are not supported",
    "lora_weights": "LoRA adapters are not supported",
    "lora_config": "LoRA adapters are not supported",
    "prompt_embedding_table": "prompt tuning tables are not supported",
    "prompt_vocab_size": "prompt tuning tables are not supported",
    "guided_decoding_guide_type": "guided decoding is not supported",
    "guided_decoding_guide": "guided decoding is not supported",
}


def word_list(encode, words: Sequence[str]) -> np.ndarray:
    """TensorRT-LLM's ``[2, N]`` INT32 word list: row 0 the ids of all words back to back,
    row 1 each word's end offset, padded with -1 (no words: ``[[0], [-1]]``)."""
    ids: list[int] = []
    offsets: list[int] = []
    for word in words:
        ids += encode(word)
        offsets.append(len(ids))
    width = max(1, len(ids))
    out = np.full((2, width), -1, dtype=np.int32)
    out[0, :] = 0
    out[0, :len(ids)] = ids
    out[1, :len(offsets)] = offsets
    return out


def parse_word_list(array: np.ndarray | None) -> list[list[int]]:
    """Inverse of :func:`word_list`."""
    if array is None:
        return []
    ids, offsets = np.asarray(array).reshape(2, -1)
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        words.append(ids[start:end].tolist())
        start = int(end)
    return [w for w in words if w]


def _words(inputs: dict[str, np.ndarray], name: str) -> list[str]:
    if name not in inputs:
        return []
    return [w.decode("utf-8") if isinstance(w, bytes) else str(w)
            for w in np.ravel(inputs[name]) if len(w)]


class Preprocessor:
    """``tokenizer``: a :class:`triton_disagg.engine.tokenizer.Tokenizer` (``encode`` for the
    prompt, ``encode_word`` for stop/bad words)."""

    def __init__(self, tokenizer: Any, max_seq_len: int, eos_id: int | None, pad_id: int | None):
        self.tokenizer, self.max_seq_len = tokenizer, max_seq_len
        self.eos_id = -1 if eos_id is None else eos_id
        self.pad_id = self.eos_id if pad_id is None else pad_id

    def process(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        self.refuse_unsupported(inputs)
        text = scalar(inputs, "text_input")
        if text is None:
            raise RequestError("text_input is missing; send the prompt as text_input (BYTES [1])")
        try:
            text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        except UnicodeDecodeError:
            raise RequestError("text_input is not valid UTF-8") from None
        max_tokens = scalar(inputs, "max_tokens")
        if max_tokens is None or int(max_tokens) < 1:
            raise RequestError(f"max_tokens must be >= 1, got {max_tokens}")
        ids = self.tokenizer.encode(text)
        if not ids:
            raise RequestError("text_input is empty after tokenization; send a non-empty prompt")
        if len(ids) + int(max_tokens) > self.max_seq_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                               f"this engine's max_seq_len {self.max_seq_len}; shorten the prompt "
                               f"or lower max_tokens")
        encode = self.tokenizer.encode_word
        return {
            "input_ids": np.array(ids, dtype=np.int32),
            "input_lengths": np.array([len(ids)], dtype=np.int32),
            "request_output_len": np.array([int(max_tokens)], dtype=np.int32),
            "stop_words_list": word_list(encode, _words(inputs, "stop_words")),
            "bad_words_list": word_list(encode, _words(inputs, "bad_words")),
            "end_id": np.array([scalar(inputs, "end_id", self.eos_id)], dtype=np.int32),
            "pad_id": np.array([scalar(inputs, "pad_id", self.pad_id)], dtype=np.int32),
        }

    @staticmethod
    def refuse_unsupported(inputs: dict[str, np.ndarray]) -> None:
        for name, (fine, why) in _REFUSED_UNLESS.items():
            value = scalar(inputs, name, fine)
            if value != fine:
                raise RequestError(f"{name} {value!r}: {why}")
        for name, why in _REFUSED_IF_PRESENT.items():
            if name in inputs:
                raise RequestError(f"{name}: {why}")

"""The ``preprocessing`` model's logic: text -> ``input_ids``, words -> id lists, defaults.

Invariants: a request it accepts fits the engine (prompt + ``max_tokens`` <=
``max_seq_len``, at least one prompt token, ``max_tokens`` >= 1) and its stop/bad word
lists fit the caps of :mod:`triton_disagg.engine.sampling`; a prompt or word that is surely
too long is refused before it is tokenized, so a huge input costs one pass over its bytes,
not a tokenization, and one over :data:`MAX_TEXT_BYTES` is refused by its length alone
(whatever the tokenizer); an input the serving stack cannot honour (beam search, several
sequences, LoRA, prompt tables, guided decoding, logits outputs) or cannot read (text
that is not UTF-8) raises :class:`RequestError` naming it, never silence.

Stop and bad words are tokenized one by one, alone, as TensorRT-LLM does, and matched as
token sequences: "happy" and " happy" (with its leading space, as it appears mid-sentence)
are different tokens in a byte-level BPE vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
# Any here: tensor dict values (numpy arrays and scalars of any dtype).

import numpy as np

from triton_disagg import peers, protocol as P
from triton_disagg.engine.sampling import MAX_WORD_TOKENS, cap_error, count_error, to_wire
from triton_disagg.errors import RequestError
from triton_disagg.triton.tensors import scalar

if TYPE_CHECKING:
    from triton_disagg.engine.tokenizer import Tokenizer

MAX_TEXT_BYTES = 10 * 2**20    # a prompt or word at most; the HTTP front's largest body too
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


def _text(value: bytes | str, name: str) -> str:
    """``value`` (bytes or text) as text, refused over :data:`MAX_TEXT_BYTES` or not UTF-8."""
    if len(value) > MAX_TEXT_BYTES:
        raise RequestError(f"{name} is {len(value)} bytes, more than the {MAX_TEXT_BYTES} "
                           f"taken; send a shorter text")
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise RequestError(f"{name} is not valid UTF-8; send it as UTF-8 text") from None


class Preprocessor:
    """``tokenizer``: a :class:`triton_disagg.engine.tokenizer.Tokenizer` (``encode`` for the
    prompt, ``encode_word`` for stop/bad words); ``seal_key``: :func:`triton_disagg.peers.
    seal_key`, which seals every output (``preprocessed``: the orchestrator takes nothing
    else)."""

    def __init__(self, tokenizer: Tokenizer, max_seq_len: int, eos_id: int | None, pad_id: int | None,
                 seal_key: bytes):
        self.tokenizer, self.max_seq_len, self.seal_key = tokenizer, max_seq_len, seal_key
        self.eos_id = -1 if eos_id is None else eos_id
        self.pad_id = self.eos_id if pad_id is None else pad_id

    def process(self, inputs: dict[str, np.ndarray],
                add_special_tokens: bool = True) -> dict[str, Any]:
        """The orchestrator's sealed inputs for the ensemble inputs ``inputs``; the prompt
        tokenized as Hugging Face's ``tokenizer(text)`` does (the special tokens, such as a
        BOS, its configuration adds), or without them (``add_special_tokens`` False: a chat
        template's output, which holds its own, as vLLM tokenizes it)."""
        self.refuse_unsupported(inputs)
        text = scalar(inputs, "text_input")
        if text is None:
            raise RequestError("text_input is missing; send the prompt as text_input (BYTES [1])")
        text = _text(text, "text_input")
        max_tokens = scalar(inputs, "max_tokens")
        if max_tokens is None:
            raise RequestError("max_tokens is required (INT32, shape [1, 1]): how many tokens "
                               "to generate at most")
        if int(max_tokens) < 1:
            raise RequestError(f"max_tokens must be >= 1, got {max_tokens}")
        max_tokens = int(max_tokens)
        room = self.max_seq_len - max_tokens          # prompt tokens that fit
        if room < 1:
            raise RequestError(f"max_tokens ({max_tokens}) leaves no room for a prompt in this "
                               f"engine's max_seq_len {self.max_seq_len}; lower max_tokens")
        if self.tokenizer.surely_more_tokens(text, room):
            raise self._too_long(f"more than {room} tokens", max_tokens)
        ids = self.tokenizer.encode(text, add_special_tokens)
        if not ids:
            raise RequestError("text_input is empty after tokenization; send a non-empty prompt")
        if len(ids) > room:
            raise self._too_long(f"{len(ids)} tokens", max_tokens)
        outputs = {
            "input_ids": np.array(ids, dtype=np.int32),
            "input_lengths": np.array([len(ids)], dtype=np.int32),
            "request_output_len": np.array([max_tokens], dtype=np.int32),
            "stop_words_list": to_wire(self.word_ids(inputs, "stop_words")),
            "bad_words_list": to_wire(self.word_ids(inputs, "bad_words")),
            "end_id": np.array([scalar(inputs, "end_id", self.eos_id)], dtype=np.int32),
            "pad_id": np.array([scalar(inputs, "pad_id", self.pad_id)], dtype=np.int32),
        }
        return self.sealed(outputs)

    def sealed(self, outputs: dict[str, Any]) -> dict[str, Any]:
        """``outputs`` (the orchestrator's preprocessed tensors) with their seal
        (``protocol.PREPROCESSED``): only for tensors this process made or checked itself,
        as :meth:`process` and the HTTP front's token-id prompts do."""
        outputs[P.PREPROCESSED] = peers.seal(outputs, self.seal_key)
        return outputs

    def _too_long(self, prompt: str, max_tokens: int) -> RequestError:
        return RequestError(f"prompt ({prompt}) + max_tokens ({max_tokens}) exceeds this "
                            f"engine's max_seq_len {self.max_seq_len}; shorten the prompt or "
                            f"lower max_tokens")

    def word_ids(self, inputs: dict[str, np.ndarray], name: str) -> list[list[int]]:
        """The BYTES input ``name``'s words as token-id lists (empty words left out), each
        word tokenized alone; a list over the caps is refused, a word surely over the
        per-word cap before it is tokenized."""
        entries = np.ravel(inputs[name]) if name in inputs else ()
        too_many = count_error(name, len(entries))
        if too_many:
            raise RequestError(too_many)
        words = []
        for i, entry in enumerate(entries):
            text = _text(entry, f"{name}[{i}]")
            if self.tokenizer.surely_more_tokens(text, MAX_WORD_TOKENS):
                raise RequestError(f"{name}[{i}]: more than {MAX_WORD_TOKENS} tokens, the most "
                                   f"allowed per word; send a shorter word")
            words.append(self.tokenizer.encode_word(text) if text else [])
        too_big = cap_error(name, words)
        if too_big:
            raise RequestError(too_big)
        return [w for w in words if w]

    @staticmethod
    def refuse_unsupported(inputs: dict[str, np.ndarray]) -> None:
        for name, (fine, why) in _REFUSED_UNLESS.items():
            value = scalar(inputs, name, fine)
            if value != fine:
                raise RequestError(f"{name} {value!r}: {why}")
        for name, why in _REFUSED_IF_PRESENT.items():
            if name in inputs:
                raise RequestError(f"{name}: {why}")

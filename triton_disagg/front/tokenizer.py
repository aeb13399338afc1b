"""Text and token ids, both ways: the engine directory's tokenizer (``tokenizer.json``, via
the ``tokenizers`` library), the ``preprocessing`` model's logic (text -> ``input_ids``,
words -> id lists, defaults, refusals, the seal) and the orchestrator's text deltas. The
engine itself sees token ids only.

Tokenizing. A prompt's ids are Hugging Face's ``tokenizer(prompt).input_ids`` (what vLLM
sends the model, so ``prompt_tokens`` counts agree): with the special tokens, such as a BOS,
that ``tokenizer.json``'s post-processor adds (``add_special_tokens=True``). transformers 5
loads that post-processor as it is for a ``tokenizer.json`` that has one, whatever
``tokenizer_config.json``'s ``add_bos_token``/``add_eos_token`` say
(tests/unit/test_prompt_tokens_vs_hf.py checks it against transformers). Text that holds its
special tokens already (a chat template's output) is encoded with
``add_special_tokens=False``, as vLLM does. Stop and bad words are tokenized one by one,
alone, never with special tokens, as TensorRT-LLM does, and matched as token sequences:
"happy" and " happy" (with its leading space, as it appears mid-sentence) are different
tokens in a byte-level BPE vocabulary. Decoding skips special tokens by default.

Preprocessing (:class:`Preprocessor`). Invariants: a request it accepts fits the engine
(prompt + ``max_tokens`` <= ``max_seq_len``, at least one prompt token, ``max_tokens`` >= 1)
and its stop/bad word lists fit the caps of :mod:`triton_disagg.engine.sampling`; a prompt
or word that is surely too long is refused before it is tokenized, so a huge input costs one
pass over its bytes, not a tokenization, and one over :data:`MAX_TEXT_BYTES` is refused by
its length alone (whatever the tokenizer); an input the serving stack cannot honour (beam
search, several sequences, LoRA, prompt tables, guided decoding, logits outputs) or cannot
read (text that is not UTF-8) raises :class:`RequestError` naming it, never silence; every
output is sealed (:func:`triton_disagg.triton.tensors.seal`).

Streamed text (:func:`text_delta`, :class:`DeltaWindows`): token ids -> text deltas,
stateless per response and correct for multi-byte characters. The orchestrator sends each
response's ids as a window ``ids`` whose first ``offset`` ids were already covered by
earlier responses. The text a response adds is ``visible(ids) - visible(ids[:offset])``,
where ``visible`` decodes and, unless the response is the final one, drops a trailing
incomplete character (U+FFFD from a split UTF-8 sequence), which then comes out with a
later response. Invariant: for windows produced by :class:`DeltaWindows` the concatenated
deltas equal ``decode(all ids)``. Decoding a window that starts mid-sequence yields the same
garbage prefix in both terms, so it cancels. The window keeps :data:`WINDOW` earlier ids: a
garbage head (at most 3 orphan bytes) plus an incomplete tail (at most 3 bytes) leave at
least one whole character between them, so trimming the tail never eats into the head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence
# Any here: tensor dict values (numpy arrays and scalars of any dtype).

import numpy as np

from triton_disagg import protocol as P
from triton_disagg.engine.sampling import MAX_WORD_TOKENS, cap_error, count_error, to_wire
from triton_disagg.engine.spec import TOKENIZER_FILE, EngineFormatError
from triton_disagg.engine.token_bound import max_token_bytes
from triton_disagg.errors import RequestError
from triton_disagg.triton.tensors import scalar, seal


# ---- the tokenizer ------------------------------------------------------------------------

class Tokenizer:
    def __init__(self, engine_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(engine_dir) / TOKENIZER_FILE
        if not path.is_file():
            raise EngineFormatError(f"{path}: not found; rebuild the engine from a checkpoint "
                                    f"that has a tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises bare Exception
            raise EngineFormatError(f"{path}: not a valid tokenizer.json ({exc})") from exc
        self.max_token_bytes = max_token_bytes(json.loads(path.read_text(encoding="utf-8")))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Prompt text to token ids, with the special tokens the tokenizer adds (module
        docstring) unless ``add_special_tokens`` is False. Encoded as a batch of one: the
        library's ``encode_batch`` lets go of the GIL while it works and ``encode`` does not
        (a 1 M character prompt held it ~0.6 s), so a prompt tokenized on a worker thread
        does not stall the front's event loop."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_word(self, text: str) -> list[int]:
        """A stop or bad word to token ids, never with special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def surely_more_tokens(self, text: str, n: int) -> bool:
        """True only if ``text`` encodes to more than ``n`` tokens, decided from its length in
        O(len) without encoding it (see :mod:`triton_disagg.engine.token_bound`); False means
        "encode to know"."""
        if self.max_token_bytes is None:
            return False
        if self._tok.normalizer is not None:
            text = self._tok.normalizer.normalize_str(text)
        return len(text.encode("utf-8")) > n * self.max_token_bytes

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


# ---- streamed text: ids -> text deltas ----------------------------------------------------

REPLACEMENT = "\ufffd"
WINDOW = 8


def text_delta(decode: Callable[[Sequence[int]], str], ids: Sequence[int], offset: int,
               is_final: bool) -> str:
    ids = list(ids)
    old = _visible(decode(ids[:offset]), trim=True) if offset else ""
    new = _visible(decode(ids), trim=not is_final)
    if new.startswith(old):
        return new[len(old):]
    # Tokenizers whose decode is not prefix-stable (rare): fall back to the longest common prefix.
    common = 0
    for a, b in zip(old, new):
        if a != b:
            break
        common += 1
    return new[common:]


def _visible(text: str, trim: bool) -> str:
    return text.rstrip(REPLACEMENT) if trim else text


class DeltaWindows:
    """Cuts a growing id sequence into (window, offset) pairs for :func:`text_delta`."""

    def __init__(self, prefix: Sequence[int] = ()):
        self.ids: list[int] = list(prefix)
        self.sent = 0              # ids covered by earlier windows

    def next(self, new_ids: Sequence[int]) -> tuple[list[int], int]:
        self.ids.extend(new_ids)
        start = max(0, self.sent - WINDOW)
        window, offset = self.ids[start:], self.sent - start
        self.sent = len(self.ids)
        return window, offset


# ---- preprocessing: the ensemble's inputs -> the orchestrator's sealed inputs --------------

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
    """``tokenizer``: a :class:`Tokenizer` (``encode`` for the prompt, ``encode_word`` for
    stop/bad words); ``seal_key``: :func:`~triton_disagg.triton.tensors.seal_key`, which seals
    every output (``preprocessed``: the orchestrator takes nothing else)."""

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
        outputs[P.PREPROCESSED] = seal(outputs, self.seal_key)
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

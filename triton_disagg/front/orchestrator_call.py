"""The HTTP front's one call to the ``orchestrator`` model: a checked
:class:`~triton_disagg.front.openai_api.Generation` -> the orchestrator's input tensors
(:class:`RequestEncoder`), sent over Triton's gRPC streaming (tritonclient's asyncio client,
:class:`Relay`), its responses back as token events with their text and counts
(:class:`~triton_disagg.engine.sequence.TokenEvent`, read by
:func:`~triton_disagg.triton.tensors.response_event`).

Why the orchestrator and not the ensemble: a client's cancel reaches a decoupled model it
calls directly, but not the steps inside an ensemble (Triton 2.51), and the orchestrator
must see it to stop generation and free the request's KV blocks. Preprocessing runs in the
front itself, on the ``preprocessing`` model's own library
(:class:`.tokenizer.Preprocessor`), so the HTTP front tokenizes, bounds and defaults a
prompt exactly as the ensemble does.

Invariants of the inputs: the model named must be the one served (else 404); a text prompt's
ids are Hugging Face's ``tokenizer(prompt)`` (a BOS when the tokenizer's configuration adds
one: :mod:`~triton_disagg.front.tokenizer`); a chat's prompt is its messages rendered by
the engine's chat template (:mod:`.chat_template`), tokenized without added special tokens
(the template writes its own, as vLLM tokenizes it); the tensors carry ``stream`` true
whatever the client asked (the front relays deltas, and a non-streamed answer is their
concatenation, which the orchestrator guarantees equal to its non-streamed text) and
``arrival_ns`` (the orchestrator's time to first token starts here); a prompt surely longer
than the engine's context is refused before it is tokenized (chat's default ``max_tokens``,
the rest of the context, needs its length: it is bounded first too); a prompt of token ids
(checked against the vocabulary by :mod:`.openai_api`) goes to the engine as sent, bounded
like a tokenized one; ``return_log_probs`` is set when the client asked for ``logprobs``,
``top_logprobs`` when it asked for alternatives (completions' ``logprobs`` N, chat's
``top_logprobs`` N > 0), and ``prompt_logprobs`` when it echoes the prompt with them.

Invariants of the call: one gRPC stream per request, half-closed once the request is sent,
so it ends when the orchestrator sends its final response; a stream that ends any other way
(the caller stops iterating: the HTTP client left, or its task was cancelled) is cancelled,
and Triton passes that cancel to the orchestrator; an error response raises
:class:`OrchestratorError` with the orchestrator's message and its
:class:`~triton_disagg.errors.ErrorCode`, once the stream has ended as usual. A Triton
stream's error message carries no status, so the request asks the orchestrator for the code
in the message (the request parameter :data:`~triton_disagg.errors.CODE_IN_MESSAGE`; read
back by :func:`~triton_disagg.errors.code_in`). An error without that tag is Triton's own
(the orchestrator tags every one it sends: e.g. the orchestrator model unknown, not loaded
or unloading): UNAVAILABLE when Triton then says the models are not ready, else INTERNAL (a
malformed request is this front's fault). Not Triton's ``triton_grpc_error`` header, which
ends the stream with the error's status instead: in Triton 2.51 that path closes the stream
from the response callback's thread, logs "HandleCancellation called even when the context
was not cancelled" for each error, and once crashed tritonserver (SIGSEGV) right after it;
Triton fixed a use-after-free of that mode later (server PR #8708).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, AsyncIterator
# Any here: tensor dict values (numpy arrays and scalars of any dtype).

import numpy as np

from triton_disagg import protocol as P
from triton_disagg.config.tls_section import GrpcTLS
from triton_disagg.engine.sampling import to_wire
from triton_disagg.engine.sequence import TokenEvent
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.errors import CODE_IN_MESSAGE, HTTP_STATUS, ErrorCode, RequestError, \
    code_in, from_grpc_status, without_tag
from triton_disagg.front.chat_template import ChatTemplate
from triton_disagg.front.field_checks import shown
from triton_disagg.front.health import ServerReadiness
from triton_disagg.front.openai_api import ApiError, Generation
from triton_disagg.front.openai_models import COMPLETION_MAX_TOKENS, EngineLimits
from triton_disagg.front.tokenizer import Preprocessor, Tokenizer
from triton_disagg.triton.grpc_channel import client_options
from triton_disagg.triton.tensors import by_name, response_event, seal_key

ORCHESTRATOR = "orchestrator"
_SPECS = by_name(P.ORCHESTRATOR_INPUTS)
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
                                spec.pad_token_id, seal_key())
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



class OrchestratorError(Exception):
    """The orchestrator answered with an error of ``code``; ``status``: the HTTP status that
    code means (:data:`~triton_disagg.errors.HTTP_STATUS`: INVALID_ARG 400, UNAVAILABLE 503,
    TIMEOUT 504, INTERNAL 500)."""

    def __init__(self, message: str, code: ErrorCode):
        super().__init__(message)
        self.code, self.status = code, HTTP_STATUS[code]

    @classmethod
    def from_status(cls, status: str, message: str) -> "OrchestratorError":
        """The error of a gRPC ``status`` ("StatusCode.UNAVAILABLE", as tritonclient names
        it) and its ``message``: a stream Triton itself ended (e.g. no such model)."""
        return cls(without_tag(message), from_grpc_status(status, message))


class Relay:
    """A tritonclient asyncio gRPC client to the server at ``url`` (``host:port``); it is
    ready while the server and ``models`` (the orchestrator among them) are."""

    def __init__(self, url: str, models: tuple[str, ...] = (ORCHESTRATOR,),
                 tls: GrpcTLS | None = None):
        import tritonclient.grpc.aio as grpcclient

        self.client = grpcclient.InferenceServerClient(url, **client_options(tls))
        with_orchestrator = tuple(dict.fromkeys((ORCHESTRATOR, *models)))   # once, first
        self.readiness = ServerReadiness(self.client, with_orchestrator)

    async def ready(self) -> str | None:
        """None when the server and its models are ready, else why not
        (:class:`~triton_disagg.front.health.ServerReadiness`)."""
        return await self.readiness.ready()

    async def stream(self, inputs: dict[str, np.ndarray],
                     request_id: str) -> AsyncIterator[TokenEvent]:
        """The orchestrator's responses to ``inputs`` (arrays with their batch axis)."""
        import grpc
        from tritonclient.grpc import InferInput
        from tritonclient.utils import np_to_triton_dtype

        tensors = []
        for name, array in inputs.items():
            tensors.append(InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype)))
            tensors[-1].set_data_from_numpy(array)

        async def one_request():
            yield {"model_name": ORCHESTRATOR, "inputs": tensors, "request_id": request_id,
                   "parameters": {CODE_IN_MESSAGE: True}}

        responses = self.client.stream_infer(one_request())
        ended, failed = False, None      # failed: the stream's error, raised once it ended
        try:
            async for result, error in responses:
                if error is not None:          # the final response: the stream ends next
                    failed = failed or await self._failure(error.message())
                elif failed is None:
                    yield response_event(request_id, result.as_numpy)
            ended = True
        except grpc.aio.AioRpcError as exc:
            ended = True                        # Triton ended the stream with a status
            raise OrchestratorError.from_status(str(exc.code()), exc.details() or "") from None
        finally:
            if not ended:
                responses.cancel()
        if failed is not None:
            raise failed

    async def _failure(self, message: str) -> OrchestratorError:
        """The error of a stream's error ``message``: its code tagged in it
        (:func:`~triton_disagg.errors.code_in`), else Triton's own error, UNAVAILABLE while
        the models are not ready and INTERNAL when they are."""
        code, text = code_in(message)
        if code is None:
            code = ErrorCode.INTERNAL if await self.ready() is None else ErrorCode.UNAVAILABLE
        return OrchestratorError(text, code)

    async def close(self) -> None:
        await self.client.close()


def unreachable(exc: Exception) -> bool:
    """True for the errors of a call that did not reach tritonserver or lost it (gRPC's own,
    the client's, the OS's), as opposed to a fault of this process."""
    import grpc
    from tritonclient.utils import InferenceServerException

    return isinstance(exc, (grpc.aio.AioRpcError, InferenceServerException, OSError))

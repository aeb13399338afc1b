"""One generate request to the ``ensemble``, timed on the client.

The request is a :class:`GenerateRequest`: prompt, ``max_tokens``, ``stream`` and
any of the ensemble's optional inputs by their tensor names (``temperature``,
``top_k``, ``seed``, ``stop_words``, ``end_id`` ...). It goes out over

- gRPC streaming (:func:`grpc_generate`, ``tritonclient.grpc.aio``): the
  ensemble is decoupled, so gRPC needs the streaming RPC even for one
  response; ``enable_empty_final_response`` marks the end;
- HTTP (:func:`http_generate`): ``/generate_stream`` (server-sent events)
  when streaming, ``/generate`` (exactly one JSON reply) otherwise. KServe
  ``/infer`` over HTTP refuses decoupled models (501), hence ``generate``;
- the HTTP front's OpenAI API (:func:`openai_generate`): ``/v1/completions``, streamed
  with ``stream_options.include_usage`` (the token counts), greedy, ``ignore_eos`` when
  the request's ``end_id`` is -1; with ``token_ids``, also the generated tokens' ids
  (``logprobs`` 0 with vLLM's ``return_tokens_as_token_ids``: each token named
  ``token_id:N``), kept in :attr:`Measurement.token_ids`.

Every response is fed to a :class:`Measurement`. Invariants: ``arrivals`` has
one entry per response that carried output, in arrival order; the token
counts are the server's (``num_output_tokens`` is cumulative, so the last
response holds the total), falling back to the number of responses.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from triton_disagg import protocol as P
from triton_disagg.triton.tensors import by_name

OnText = Callable[[str], None]
_SPECS = by_name(P.ENSEMBLE_INPUTS)
_WORD_INPUTS = ("stop_words", "bad_words")


class GenerateError(RuntimeError):
    """The server answered the request with an error (its message is kept as is)."""


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str | tuple[int, ...]     # token ids: only over the HTTP front (openai_body)
    max_tokens: int
    stream: bool = True
    options: Mapping[str, Any] = field(default_factory=dict)   # optional ensemble inputs by name
    token_ids: bool = False          # HTTP front only: ask for the generated tokens' ids

    def __post_init__(self) -> None:
        unknown = sorted(set(self.options) - set(_SPECS))
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not an input of the ensemble")

    def tensors(self) -> dict[str, np.ndarray]:
        """Ensemble inputs with their batch axis: scalars ``[1, 1]``, word lists ``[1, n]``."""
        values = {"text_input": self.prompt.encode("utf-8"), "max_tokens": self.max_tokens,
                  "stream": self.stream, "return_num_input_tokens": True,
                  "return_num_output_tokens": True, **self.options}
        out = {}
        for name, value in values.items():
            spec = _SPECS[name]
            if name in _WORD_INPUTS:
                value = [w.encode("utf-8") for w in value]
            out[name] = np.array(value, dtype=spec.numpy_dtype).reshape(1, -1)
        return out

    def json(self) -> dict[str, Any]:
        """The body of an HTTP ``generate`` / ``generate_stream`` request."""
        return {"text_input": self.prompt, "max_tokens": self.max_tokens, "stream": self.stream,
                "return_num_input_tokens": True, "return_num_output_tokens": True,
                **{k: (list(v) if k in _WORD_INPUTS else v) for k, v in self.options.items()}}


@dataclass
class Measurement:
    """Client-side timing of one request (``time.perf_counter`` seconds)."""

    start: float = field(default_factory=time.perf_counter)
    arrivals: list[float] = field(default_factory=list)
    counts: list[int | None] = field(default_factory=list)   # num_output_tokens per response
    end: float | None = None
    text: list[str] = field(default_factory=list)
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    token_ids: list[int] = field(default_factory=list)   # generated, when the request asked

    def on_response(self, text: str, n_in: int | None, n_out: int | None,
                    at: float | None = None) -> None:
        """Record a response that arrived ``at`` (default: now)."""
        self.arrivals.append(time.perf_counter() if at is None else at)
        self.counts.append(n_out)
        self.text.append(text)
        self.num_input_tokens = n_in if n_in is not None else self.num_input_tokens
        self.num_output_tokens = n_out if n_out is not None else self.num_output_tokens

    def finish(self) -> "Measurement":
        self.end = time.perf_counter()
        return self

    @property
    def output_tokens(self) -> int:
        return self.num_output_tokens if self.num_output_tokens is not None else len(self.arrivals)

    @property
    def e2e(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0] - self.start if self.arrivals else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (last - first arrival) / (tokens - 1).
        None when the reply came in one piece or holds one token."""
        if len(self.arrivals) < 2 or self.output_tokens < 2:
            return None
        return (self.arrivals[-1] - self.arrivals[0]) / (self.output_tokens - 1)

    @property
    def token_times(self) -> list[float]:
        """Each output token's arrival: a response carrying k tokens gives k equal times (one
        token per response where the server gave no counts)."""
        if None in self.counts:
            return list(self.arrivals)
        tokens = [b - a for a, b in zip([0] + self.counts, self.counts)]
        return [t for t, k in zip(self.arrivals, tokens) for _ in range(k)]

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive tokens when streaming: a response carrying k tokens (the
        server sends tokens that were ready together as one) adds its gap, then k - 1 zeros."""
        gaps = np.diff(self.arrivals).tolist()
        if None in self.counts:
            return gaps
        extra = [max(0, b - a - 1) for a, b in zip(self.counts, self.counts[1:])]
        return [g for gap, k in zip(gaps, extra) for g in [gap] + [0.0] * k]


def _first(array: Any) -> Any:
    return None if array is None else np.asarray(array).reshape(-1)[0]


def _int(value: Any) -> int | None:
    value = _first(value) if isinstance(value, (list, np.ndarray)) else value
    return None if value is None else int(value)


def read_result(result: Any) -> tuple[str | None, int | None, int | None, bool]:
    """(text, num_input_tokens, num_output_tokens, final) of a tritonclient gRPC result;
    text is None for the empty final response."""
    text = _first(result.as_numpy("text_output"))
    final = result.get_response().parameters["triton_final_response"].bool_param
    return (None if text is None else text.decode("utf-8"),
            _int(result.as_numpy("num_input_tokens")), _int(result.as_numpy("num_output_tokens")),
            final)


def array_inputs(arrays: Mapping[str, np.ndarray]) -> list:
    """tritonclient gRPC inputs for ``{name: numpy array}``, each typed by its array's dtype
    (object arrays as BYTES), so a test or the soak can send a tensor of the wrong type."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, array in arrays.items():
        dtype = "BYTES" if array.dtype == object else grpcclient.np_to_triton_dtype(array.dtype)
        inputs.append(grpcclient.InferInput(name, list(array.shape), dtype))
        inputs[-1].set_data_from_numpy(array)
    return inputs


def grpc_inputs(request: GenerateRequest) -> list:
    """``request``'s tensors as tritonclient gRPC inputs (their dtypes the ensemble's)."""
    return array_inputs(request.tensors())


async def grpc_generate(client: Any, request: GenerateRequest, model: str = "ensemble",
                        on_text: OnText | None = None) -> Measurement:
    """Send ``request`` on its own stream of a ``tritonclient.grpc.aio`` client."""
    measurement = Measurement()
    inputs = grpc_inputs(request)

    async def one_request():
        yield {"model_name": model, "inputs": inputs, "enable_empty_final_response": True}

    responses = client.stream_infer(one_request())
    try:
        async for result, error in responses:
            if error is not None:
                raise GenerateError(error.message())
            text, n_in, n_out, final = read_result(result)
            if text is not None:
                measurement.on_response(text, n_in, n_out)
                if on_text is not None:
                    on_text(text)
            if final:
                return measurement.finish()
    finally:
        responses.cancel()
    raise GenerateError("the stream ended before the final response")


def parse_event(payload: dict) -> tuple[str, int | None, int | None]:
    """(text, num_input_tokens, num_output_tokens) of one HTTP generate reply or SSE event."""
    if "error" in payload:
        raise GenerateError(str(payload["error"]))
    text = payload.get("text_output", "")
    text = "".join(text) if isinstance(text, list) else str(text)
    return text, _int(payload.get("num_input_tokens")), _int(payload.get("num_output_tokens"))


def sse_events(lines) -> Any:
    """JSON payloads of the ``data:`` lines of a server-sent event stream (bytes lines)."""
    for raw in lines:
        line = raw.decode("utf-8").strip() if isinstance(raw, bytes) else raw.strip()
        if line.startswith("data:"):
            yield json.loads(line[len("data:"):])


def _error_text(body: str) -> str:
    """The message of an error reply: ``{"error": ...}``, possibly as an SSE ``data:`` line."""
    try:
        return str(json.loads(body.strip().removeprefix("data:")).get("error", body))
    except (ValueError, AttributeError):
        return body


def http_generate(url: str, request: GenerateRequest, model: str = "ensemble",
                  on_text: OnText | None = None, session: Any = None,
                  timeout: float = 600.0) -> Measurement:
    """POST ``request`` to ``{url}/v2/models/{model}/generate[_stream]`` with ``requests``."""
    import requests

    http = session or requests
    endpoint = "generate_stream" if request.stream else "generate"
    measurement = Measurement()
    with http.post(f"{url.rstrip('/')}/v2/models/{model}/{endpoint}", json=request.json(),
                   stream=request.stream, timeout=timeout) as reply:
        if reply.status_code != 200:
            raise GenerateError(f"HTTP {reply.status_code}: {_error_text(reply.text)}")
        payloads = sse_events(reply.iter_lines()) if request.stream else [reply.json()]
        for payload in payloads:
            text, n_in, n_out = parse_event(payload)
            measurement.on_response(text, n_in, n_out)
            if on_text is not None:
                on_text(text)
    return measurement.finish()


def openai_body(request: GenerateRequest, model: str) -> dict[str, Any]:
    """The ``/v1/completions`` body of ``request``: prompt (text or token ids) and
    ``max_tokens``, greedy, streamed with the usage chunk; of its options only ``end_id``
    -1, as ``ignore_eos``; ``token_ids``: the tokens named by id in ``logprobs``."""
    prompt = request.prompt if isinstance(request.prompt, str) else list(request.prompt)
    ids = {"logprobs": 0, "return_tokens_as_token_ids": True} if request.token_ids else {}
    return {"model": model, "prompt": prompt, "max_tokens": request.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": request.options.get("end_id") == -1, **ids}


def on_openai_line(measurement: Measurement, raw: bytes | str) -> bool:
    """Feed one line of a ``/v1/completions`` event stream; True once it is ``[DONE]``."""
    line = raw.decode("utf-8").strip() if isinstance(raw, bytes) else raw.strip()
    if not line.startswith("data: "):
        return False
    if line == "data: [DONE]":
        measurement.finish()
        return True
    chunk = json.loads(line[len("data: "):])
    if "error" in chunk:
        raise GenerateError(str(chunk["error"].get("message", chunk["error"])))
    if chunk.get("usage"):
        measurement.num_input_tokens = chunk["usage"]["prompt_tokens"]
        measurement.num_output_tokens = chunk["usage"]["completion_tokens"]
    elif chunk["choices"]:
        choice = chunk["choices"][0]
        if choice.get("logprobs"):
            measurement.token_ids += [_token_id(t) for t in choice["logprobs"]["tokens"]]
        if choice["text"]:
            measurement.on_response(choice["text"], None, None)
    return False


def _token_id(name: str) -> int:
    """The id in a token's ``token_id:N`` name (``return_tokens_as_token_ids``)."""
    prefix, _, number = name.partition(":")
    if prefix != "token_id" or not number.isdigit():
        raise GenerateError(f"log-probs name a token {name[:40]!r}, not token_id:N")
    return int(number)


def openai_generate(front: str, request: GenerateRequest, model: str, session: Any = None,
                    timeout: float = 600.0) -> Measurement:
    """POST ``request`` (:func:`openai_body`) to the HTTP front's ``{front}/v1/completions``
    with ``requests``. A stream that ends without ``data: [DONE]`` is an error."""
    import requests

    http = session or requests
    measurement = Measurement()
    with http.post(f"{front.rstrip('/')}/v1/completions", json=openai_body(request, model),
                   stream=True, timeout=timeout) as reply:
        if reply.status_code != 200:
            raise GenerateError(f"HTTP {reply.status_code}: {_error_text(reply.text)}")
        for raw in reply.iter_lines():
            if on_openai_line(measurement, raw):
                return measurement
    raise GenerateError("the stream ended without data: [DONE]")


async def openai_generate_async(session: Any, front: str, request: GenerateRequest,
                                model: str) -> Measurement:
    """:func:`openai_generate` on an ``aiohttp.ClientSession``."""
    measurement = Measurement()
    async with session.post(f"{front.rstrip('/')}/v1/completions",
                            json=openai_body(request, model)) as reply:
        if reply.status != 200:
            raise GenerateError(f"HTTP {reply.status}: {_error_text(await reply.text())}")
        async for raw in reply.content:
            if on_openai_line(measurement, raw):
                return measurement
    raise GenerateError("the stream ended without data: [DONE]")

"""Locust load test of the served ensemble (gRPC streaming, HTTP ``generate_stream``) and of
the HTTP front's OpenAI API.

    locust -f clients/locustfile.py --headless -u 8 -r 8 -t 20s --host http://127.0.0.1:8000

Users (pick one by class name after the options, default all three):

- ``GrpcStreamUser``: ``tritonclient.grpc`` streaming, one stream per user
  (grpc made gevent-cooperative with ``grpc.experimental.gevent.init_gevent``);
- ``HttpStreamUser``: ``requests`` against ``/generate_stream`` (server-sent
  events; locust's gevent patching makes it cooperative);
- ``OpenAIStreamUser``: ``requests`` against the HTTP front's streamed
  ``/v1/completions`` (``stream_options.include_usage`` for the token counts; with
  ``TD_IGNORE_EOS`` it sends ``ignore_eos``).

Each request is recorded as three locust entries of its user's type
(``grpc_stream`` / ``http_stream`` / ``openai_stream``): ``ttft`` (first response),
``time_per_output_token`` (after the first) and ``e2e``, whose "size" is the
number of output tokens. A failed request is one failed ``e2e`` entry; with
``TD_IGNORE_EOS=1`` (default) a reply shorter than ``max_tokens`` also fails.

Environment:

- ``TD_PROMPT_TOKENS`` / ``TD_OUTPUT_TOKENS``: length distributions
  (``64``, ``uniform:32,128``, ``normal:64,16``, ``lognormal:64,0.5``;
  defaults ``uniform:16,64`` / ``uniform:16,64``);
- ``TD_TOKENIZER``: an engine directory, to make prompts of exact token counts;
- ``TD_GRPC_URL``: default the ``--host``'s host at its port + 1 (Triton's 8000/8001);
- ``TD_FRONT_URL``: the HTTP front, default the ``--host``'s host at port 8080;
  ``TD_OPENAI_MODEL``: the model id, default the first of its ``/v1/models``;
- ``TD_MODEL`` (``ensemble``), ``TD_SEED``, ``TD_WAIT_SECONDS`` (0: closed loop),
  ``TD_IGNORE_EOS`` (``1``: send ``end_id -1`` so every reply has ``max_tokens`` tokens).
"""

from __future__ import annotations

import os
import random
import time
from urllib.parse import urlsplit

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()   # before any grpc channel exists

import gevent.queue  # noqa: E402
from locust import User, constant, task  # noqa: E402

from triton_disagg.clients.stream import (  # noqa: E402
    GenerateError, GenerateRequest, Measurement, grpc_inputs, http_generate, openai_generate,
    read_result)
from triton_disagg.clients.workload import Lengths, make_prompt  # noqa: E402

MODEL = os.environ.get("TD_MODEL", "ensemble")
PROMPT_TOKENS = Lengths.parse(os.environ.get("TD_PROMPT_TOKENS", "uniform:16,64"), "TD_PROMPT_TOKENS")
OUTPUT_TOKENS = Lengths.parse(os.environ.get("TD_OUTPUT_TOKENS", "uniform:16,64"), "TD_OUTPUT_TOKENS")
IGNORE_EOS = os.environ.get("TD_IGNORE_EOS", "1") == "1"
REPLY_TIMEOUT = 300.0


def _tokenizer():
    path = os.environ.get("TD_TOKENIZER")
    if not path:
        return None
    from triton_disagg.front.tokenizer import Tokenizer

    return Tokenizer(path)


TOKENIZER = _tokenizer()


class _GenerateUser(User):
    """Draws a request, sends it with :meth:`send`, and records the three entries."""

    abstract = True
    kind = ""
    wait_time = constant(float(os.environ.get("TD_WAIT_SECONDS", "0")))

    def on_start(self) -> None:
        seed = os.environ.get("TD_SEED")
        self.rng = random.Random(None if seed is None else f"{seed}-{id(self)}")

    def send(self, request: GenerateRequest) -> Measurement:
        raise NotImplementedError

    @task
    def generate(self) -> None:
        max_tokens = OUTPUT_TOKENS.sample(self.rng)
        request = GenerateRequest(make_prompt(PROMPT_TOKENS.sample(self.rng), self.rng, TOKENIZER),
                                  max_tokens, True, {"end_id": -1} if IGNORE_EOS else {})
        start = time.perf_counter()
        try:
            m = self.send(request)
            if IGNORE_EOS and m.output_tokens != max_tokens:
                raise GenerateError(f"asked for {max_tokens} tokens, got {m.output_tokens}")
        except Exception as exc:  # noqa: BLE001 - every failure is a failed request in the stats
            self._fire("e2e", time.perf_counter() - start, 0, exc)
            return
        self._fire("ttft", m.ttft, m.output_tokens)
        if m.tpot is not None:
            self._fire("time_per_output_token", m.tpot, m.output_tokens)
        self._fire("e2e", m.e2e, m.output_tokens)

    def _fire(self, name: str, seconds: float, tokens: int, exc: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type=self.kind, name=name, response_time=seconds * 1000.0,
            response_length=tokens, exception=exc, context={})


class GrpcStreamUser(_GenerateUser):
    kind = "grpc_stream"

    def on_start(self) -> None:
        import tritonclient.grpc as grpcclient

        super().on_start()
        url = os.environ.get("TD_GRPC_URL")
        if not url:
            host = urlsplit(self.host or "http://127.0.0.1:8000")
            url = f"{host.hostname}:{(host.port or 8000) + 1}"
        self.replies: gevent.queue.Queue = gevent.queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.replies.put(
            (time.perf_counter(), result, error)))

    def on_stop(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()

    def send(self, request: GenerateRequest) -> Measurement:
        m = Measurement()
        self.client.async_stream_infer(MODEL, grpc_inputs(request),
                                       enable_empty_final_response=True)
        while True:
            at, result, error = self.replies.get(timeout=REPLY_TIMEOUT)
            if error is not None:
                raise GenerateError(error.message())
            text, n_in, n_out, final = read_result(result)
            if text is not None:
                m.on_response(text, n_in, n_out, at)
            if final:
                return m.finish()


class HttpStreamUser(_GenerateUser):
    kind = "http_stream"

    def on_start(self) -> None:
        import requests

        super().on_start()
        self.session = requests.Session()

    def on_stop(self) -> None:
        self.session.close()

    def send(self, request: GenerateRequest) -> Measurement:
        return http_generate(self.host, request, MODEL, session=self.session,
                             timeout=REPLY_TIMEOUT)


class OpenAIStreamUser(_GenerateUser):
    kind = "openai_stream"

    def on_start(self) -> None:
        import requests

        super().on_start()
        host = urlsplit(self.host or "http://127.0.0.1:8000")
        self.front = os.environ.get("TD_FRONT_URL") or f"{host.scheme}://{host.hostname}:8080"
        self.session = requests.Session()
        self.model = os.environ.get("TD_OPENAI_MODEL") or self.session.get(
            f"{self.front}/v1/models", timeout=30).json()["data"][0]["id"]

    def on_stop(self) -> None:
        self.session.close()

    def send(self, request: GenerateRequest) -> Measurement:
        return openai_generate(self.front, request, self.model, session=self.session,
                               timeout=REPLY_TIMEOUT)

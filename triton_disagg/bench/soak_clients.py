"""The soak's own clients: requests whose every end it times (see :mod:`.soak_watch`).

- a cancel client cycles through: a gRPC stream cancelled after its first token
  (``stop_stream(cancel_requests=True)``), a complete gRPC request (exactly
  ``max_tokens`` tokens, end id off), a gRPC stream cancelled mid-way, an HTTP
  ``generate_stream`` whose connection is closed mid-way, and a long prompt
  (``LONG_PROMPT`` tokens) cancelled at its first token, while generation still
  fetches its KV (with ``--overlap_kv_transfer``, while it READs it layer by layer);
- the bad-input client sends, one every ``BAD_INPUT_PAUSE`` seconds, requests the
  ensemble must refuse with an error (missing or negative ``max_tokens``, invalid
  UTF-8 in ``stop_words``, a prompt far over the engine's length, ``beam_width`` 2,
  ``max_tokens`` of the wrong dtype), over gRPC and HTTP.

Invariant: every request is one :class:`Record` of the :class:`RequestLog`, ended with
``ok`` (finished as asked, or cancelled where the client meant to), ``expected_error``
(a bad input refused), or ``unexpected_error`` (a good request that failed, a bad input
that succeeded); a request whose reply never comes stays open and counts as hung once
its deadline passes. Only the public ensemble is called.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from typing import Any

import numpy as np

from triton_disagg.bench.soak_watch import Record, RequestLog, token_count_problem
from triton_disagg.clients.stream import array_inputs

MODEL = "ensemble"
BAD_INPUT_PAUSE = 2.0
LONG_PROMPT = (600, 1200)    # tokens of the long prompts cancelled during their KV transfer
KINDS = ("cancel after first token (gRPC)", "complete (gRPC)", "cancel mid-stream (gRPC)",
         "cancel mid-stream (SSE)", "bad input (gRPC)", "bad input (HTTP)", "probe after settle",
         "long prompt cancelled in its KV transfer (gRPC)")
CANCEL_SHAPES = (0, 1, 2, 3, 7)          # the cancel client's cycle, as indices of KINDS


def _text(s: str | bytes) -> np.ndarray:
    return np.array([[s.encode() if isinstance(s, str) else s]], dtype=object)


def _i32(v: int) -> np.ndarray:
    return np.array([[v]], dtype=np.int32)


def bad_grpc_inputs(prompt: str) -> list[tuple[str, dict[str, np.ndarray]]]:
    """(what is wrong, tensors) pairs that the ensemble must answer with an error."""
    base = {"text_input": _text(prompt), "stream": np.array([[True]])}
    return [
        ("missing max_tokens", dict(base)),
        ("negative max_tokens", {**base, "max_tokens": _i32(-5)}),
        ("invalid UTF-8 stop word", {**base, "max_tokens": _i32(8),
                                     "stop_words": np.array([[b"ok", b"\xff\xfe"]], dtype=object)}),
        ("huge text", {**base, "text_input": _text("word " * 200_000), "max_tokens": _i32(8)}),
        ("beam_width 2", {**base, "max_tokens": _i32(8), "beam_width": _i32(2)}),
        ("max_tokens as FP32", {**base, "max_tokens": np.array([[8.0]], dtype=np.float32)}),
    ]


def bad_http_bodies(prompt: str) -> list[tuple[str, str, dict]]:
    """(what is wrong, endpoint, JSON body) triples that must get an error."""
    return [
        ("missing max_tokens", "generate_stream", {"text_input": prompt, "stream": True}),
        ("max_tokens not a number", "generate", {"text_input": prompt, "max_tokens": "x"}),
        ("negative max_tokens", "generate_stream",
         {"text_input": prompt, "max_tokens": -1, "stream": True}),
        ("beam_width 2", "generate", {"text_input": prompt, "max_tokens": 8, "beam_width": 2}),
    ]


class GrpcStreams:
    """One tritonclient gRPC client; each request gets a stream of its own."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)

    def send(self, log: RequestLog, record: Record, arrays: dict[str, np.ndarray],
             stop_after: int | None, refused: str | None = None) -> None:
        """Stream one request; cancel it after ``stop_after`` text responses (None: read to
        the end). A reply read to its end must hold ``record.max_tokens`` tokens
        (:func:`token_count_problem`); with ``refused`` (what is wrong with the input) an
        error reply is the right answer and any other is not. Leaves ``record`` open when
        no reply comes in time."""
        from triton_disagg.clients.stream import read_result

        replies: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: replies.put((result, error)))
        try:
            self.client.async_stream_infer(MODEL, array_inputs(arrays),
                                           enable_empty_final_response=True)
            count, n_out = 0, None
            while True:
                try:
                    wait = max(0.1, record.deadline - time.monotonic())
                    result, error = replies.get(timeout=wait)
                except queue.Empty:
                    return                                  # stays open: hung
                if error is not None:
                    return log.finish(record, "expected_error" if refused is not None
                                      else "unexpected_error", error.message())
                text, _, out, final = read_result(result)
                count += text is not None
                n_out = out if out is not None else n_out
                if final and refused is not None:
                    return log.finish(record, "unexpected_error", f"{refused}: answered with "
                                      f"{count} responses instead of an error")
                if final:
                    problem = token_count_problem(count, n_out, record.max_tokens)
                    return log.finish(record, "unexpected_error" if problem else "ok",
                                      problem or "", miscounted=problem is not None)
                if stop_after is not None and count >= stop_after:
                    return log.finish(record, "ok")      # cancelled below, as meant
        finally:
            self.client.stop_stream(cancel_requests=True)

    def refused(self, log: RequestLog, record: Record, arrays: dict[str, np.ndarray],
                what: str) -> None:
        """Send a bad input: an error reply is expected, a final success is not."""
        self.send(log, record, arrays, None, refused=what)

    def close(self) -> None:
        self.client.close()


def sse_cancel(log: RequestLog, record: Record, http: str, body: dict, stop_after: int) -> None:
    """``generate_stream``, closing the connection after ``stop_after`` events."""
    import requests

    events = 0
    try:
        with requests.post(f"{http}/v2/models/{MODEL}/generate_stream", json=body, stream=True,
                           timeout=(10, max(1.0, record.deadline - time.monotonic()))) as reply:
            if reply.status_code != 200:
                return log.finish(record, "unexpected_error", f"HTTP {reply.status_code}")
            for line in reply.iter_lines():
                if line.startswith(b"data:"):
                    if b'"error"' in line:
                        return log.finish(record, "unexpected_error", line.decode()[:200])
                    events += 1
                    if events >= stop_after:
                        break
        log.finish(record, "ok")                            # closed mid-stream, or ended early
    except requests.RequestException as exc:
        if time.monotonic() <= record.deadline:
            log.finish(record, "unexpected_error", f"{type(exc).__name__}: {exc}")


def http_refused(log: RequestLog, record: Record, http: str, endpoint: str, body: dict,
                 what: str) -> None:
    import requests

    try:
        reply = requests.post(f"{http}/v2/models/{MODEL}/{endpoint}", json=body,
                              timeout=max(1.0, record.deadline - time.monotonic()))
    except requests.RequestException as exc:
        if time.monotonic() <= record.deadline:
            log.finish(record, "unexpected_error", f"{what}: {type(exc).__name__}: {exc}")
        return
    if reply.status_code != 200 or '"error"' in reply.text:
        log.finish(record, "expected_error")
    else:
        log.finish(record, "unexpected_error", f"{what}: HTTP 200 without an error")


def _prompt(rng: random.Random, tokenizer: Any, tokens: tuple[int, int] = (16, 64)) -> str:
    from triton_disagg.clients.workload import make_prompt

    return make_prompt(rng.randint(*tokens), rng, tokenizer)


def cancel_client(grpc: str, http: str, log: RequestLog, stop: threading.Event, seed: int,
                  tokenizer: Any = None) -> None:
    """Loop over the five request shapes of the module docstring until ``stop``."""
    rng, streams = random.Random(seed), GrpcStreams(grpc)
    try:
        for step in range(1 << 30):
            if stop.is_set():
                return
            shape = CANCEL_SHAPES[step % len(CANCEL_SHAPES)]
            prompt = _prompt(rng, tokenizer, LONG_PROMPT if shape == 7 else (16, 64))
            n = rng.randint(64, 160) if shape != 1 else rng.randint(16, 48)
            arrays = {"text_input": _text(prompt), "max_tokens": _i32(n),
                      "stream": np.array([[True]]), "end_id": _i32(-1)}
            record = log.begin(KINDS[shape], n)
            if shape == 3:
                sse_cancel(log, record, http, {"text_input": prompt, "max_tokens": n,
                                               "stream": True, "end_id": -1}, n // 2)
            else:
                stop_after = {0: 1, 1: None, 2: n // 2, 7: 1}[shape]
                streams.send(log, record, arrays, stop_after)
    finally:
        streams.close()


def bad_input_client(grpc: str, http: str, log: RequestLog, stop: threading.Event, seed: int,
                     tokenizer: Any = None) -> None:
    """One bad request every ``BAD_INPUT_PAUSE`` seconds, gRPC and HTTP in turn."""
    rng, streams = random.Random(seed), GrpcStreams(grpc)
    try:
        for step in range(1 << 30):
            if stop.wait(0 if step == 0 else BAD_INPUT_PAUSE):
                return
            prompt = _prompt(rng, tokenizer)
            if step % 2 == 0:
                cases = bad_grpc_inputs(prompt)
                what, arrays = cases[(step // 2) % len(cases)]
                streams.refused(log, log.begin(KINDS[4], 8), arrays, what)
            else:
                cases = bad_http_bodies(prompt)
                what, endpoint, body = cases[(step // 2) % len(cases)]
                http_refused(log, log.begin(KINDS[5], 8), http, endpoint, body, what)
    finally:
        streams.close()


def probe(grpc: str, log: RequestLog, tokenizer: Any = None) -> None:
    """One complete request after the load and the settle: the server still serves."""
    streams, n = GrpcStreams(grpc), 16
    arrays = {"text_input": _text(_prompt(random.Random(1), tokenizer)), "max_tokens": _i32(n),
              "stream": np.array([[True]]), "end_id": _i32(-1)}
    try:
        streams.send(log, log.begin(KINDS[6], n), arrays, None)
    finally:
        streams.close()

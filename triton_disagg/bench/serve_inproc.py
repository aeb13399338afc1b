"""The serving-overhead baseline: the same requests on :class:`LLMEngine` in this process.

Each request is tokenized, added to the engine and stepped exactly as the
generation model's decode loop does (continuous batching, one token per step
per sequence), with each new token detokenized, but no Triton, no gRPC, no
ensemble, no KV handoff. Timings are recorded into the same
:class:`Measurement` the clients use, so the figures compare one to one.

:meth:`InProcessEngine.decode_rate` is the ceiling of a generation server on the
engine's cores: the output tokens/s of decode steps alone (no prefill, no tokenizing or
detokenizing, no serving), every request in the batch at once.

Invariants: ``end_id -1`` in a request's options maps to ``end_id=None`` (the
reply has exactly ``max_tokens`` tokens), as the server does; other options
are not applied (the benchmark sends greedy requests); BLAS runs on at most
``threads`` threads, like a server instance pinned to that many cores (the caller
pins the process, :func:`bench.affinity.pinned`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from triton_disagg.clients.load import LoadRun, Outcome
from triton_disagg.clients.stream import GenerateRequest, Measurement


class InProcessEngine:
    def __init__(self, engine_dir: Path, threads: int):
        from threadpoolctl import threadpool_limits

        from triton_disagg.engine.llm_engine import LLMEngine
        from triton_disagg.engine.spec import EngineSpec
        from triton_disagg.front.tokenizer import Tokenizer

        self.limits = threadpool_limits(limits=threads)
        self.engine = LLMEngine(engine_dir)
        self.tokenizer = Tokenizer(engine_dir)
        self.eos = EngineSpec.load(engine_dir).eos_token_id

    def close(self) -> None:
        """Give BLAS back the threads it had before this engine limited them."""
        self.limits.restore_original_limits()

    def _add(self, key: str, request: GenerateRequest) -> int:
        from triton_disagg.engine.sampling import SamplingParams

        end_id = request.options.get("end_id", self.eos)
        ids = self.tokenizer.encode(request.prompt)
        self.engine.add_request(key, ids, SamplingParams(
            max_tokens=request.max_tokens, end_id=None if end_id is None or end_id < 0 else end_id))
        return len(ids)

    def run(self, requests: Sequence[GenerateRequest], rate: float) -> LoadRun:
        """``rate`` 0: one request at a time; ``inf``: all at once (see :mod:`triton_disagg.clients.load`)."""
        if rate not in (0, float("inf")):
            raise ValueError("the in-process baseline runs one at a time (0) or all at once (inf)")
        outcomes = [Outcome(r) for r in requests]
        start = time.perf_counter()
        groups = [[i] for i in range(len(requests))] if rate == 0 else [list(range(len(requests)))]
        for group in groups:
            self._serve({str(i): outcomes[i] for i in group})
        return LoadRun(rate, outcomes, time.perf_counter() - start)

    def decode_rate(self, requests: Sequence[GenerateRequest]) -> float:
        """Output tokens/s over the decode steps of ``requests`` sent all at once. A step
        prefills (the sequences it admits) or decodes (every running one), never both; a
        prefill step, told by its tokens being their requests' first, is left out."""
        keys = [f"decode-{i}" for i in range(len(requests))]
        for key, request in zip(keys, requests):
            self._add(key, request)
        started: set[str] = set()
        tokens, seconds = 0, 0.0
        while self.engine.has_unfinished():
            start = time.perf_counter()
            events = self.engine.step()
            elapsed = time.perf_counter() - start
            if events and events[0].request_id in started:
                tokens += len(events)
                seconds += elapsed
            started.update(e.request_id for e in events)
        return tokens / seconds if seconds else 0.0

    def _serve(self, live: dict[str, Outcome]) -> None:
        prompt_lens = {}
        for key, outcome in live.items():
            outcome.measurement = Measurement()
            prompt_lens[key] = self._add(key, outcome.request)
        counts = dict.fromkeys(live, 0)
        while self.engine.has_unfinished():
            for event in self.engine.step():
                counts[event.request_id] += 1
                text = self.tokenizer.decode(event.tokens)
                live[event.request_id].measurement.on_response(
                    text, prompt_lens[event.request_id], counts[event.request_id])
                if event.final:
                    live[event.request_id].measurement.finish()

"""Generation's admission and fetches without a server, the fakes both test files share
(tests/unit/test_generation_admission.py, test_generation_fetch.py): two real engines on the
demo checkpoint, a context pool of 64 blocks and a generation pool of 10 blocks of 4 tokens,
between which the KV moves by a plain copy (:class:`CopyConnector`; the transports have their
own tests, test_kv_exchange.py), and the decode loop's outbox and stop socket as plain
objects."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.sequence import EngineRequest
from triton_disagg.engine.spec import KVLayout
from triton_disagg.generation.decode_loop import DecodeAdmission, FetchedKV
from triton_disagg.kv.connector import Transfer
from triton_disagg.kv.handle import TransferStats

LAYOUT = KVLayout(tokens_per_block=4, dtype="float32")
WAIT_SECONDS = 20.0


@dataclass(frozen=True)
class Copied(Transfer):
    """The Transfer of a copy done inside ``start_fetch``: polls done at once."""

    stats: TransferStats

    def poll(self) -> TransferStats:
        return self.stats


@dataclass(frozen=True)
class CopyHandle:
    num_tokens: int
    block_ids: list[int]          # in the context pool, which the handle owns
    request_id: str


class CopyConnector:
    """The connector's ``start_fetch`` contract over a plain copy: fill the first blocks of
    the reservation with the handle's KV, then free the context blocks (as a transport
    does); the fetch is complete when it returns. Each start is recorded, and waits for
    ``release``: the loop then meets every submitted request at once (as under load),
    deterministically."""

    strategy = "copy"

    def __init__(self, context: LLMEngine, generation: LLMEngine):
        self.context, self.generation = context, generation
        self.started, self.release = [], threading.Event()
        self.release.set()
        self.failing: set[str] = set()          # request ids whose fetch raises

    def can_skip(self, handle: CopyHandle) -> bool:
        return False                            # copies every block

    def start_fetch(self, handle: CopyHandle, reserved, cached_blocks=0):
        self.started.append(handle.request_id)
        self.release.wait(WAIT_SECONDS)
        if handle.request_id in self.failing:
            self.context.pool.free(handle.block_ids)
            raise RuntimeError(f"KV lease of {handle.request_id} expired")
        blocks = list(reserved[:len(handle.block_ids)])
        self.generation.pool.write_blocks(blocks, self.context.pool.read_blocks(handle.block_ids))
        self.context.pool.free(handle.block_ids)
        return Copied(TransferStats(0, 0.0))

    def close(self):
        pass



def two_pools(demo_engine) -> tuple[LLMEngine, DecodeAdmission]:
    """The context engine, and generation's admission over its own engine, joined by a
    :class:`CopyConnector`."""
    context = LLMEngine(demo_engine, num_blocks=64, kv_layout=LAYOUT)
    generation = LLMEngine(demo_engine, num_blocks=10, kv_layout=LAYOUT)
    side = DecodeAdmission(generation, None)
    side.connector = CopyConnector(context, generation)
    return context, side


class Finals:
    """The loop's outbox: collects each request's token events; ``wait(n)`` until n
    requests have their final one."""

    def __init__(self):
        self.emits: dict[str, list] = {}
        self.cond = threading.Condition()

    def put(self, address, event):
        with self.cond:
            self.emits.setdefault(event.request_id, []).append(event)
            self.cond.notify_all()

    max_sockets = 64

    def flush(self, keep=()):
        return {}                          # every event reached its orchestrator

    def close(self):
        pass

    def wait(self, n: int, timeout: float = WAIT_SECONDS) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: sum(e.final for v in self.emits.values()
                                                  for e in v) >= n, timeout)

    def tokens(self, rid: str) -> list[int]:
        return [t for event in self.emits[rid] for t in event.tokens]


class StopsFor:
    """The control socket, as the loop sees it: a stop for ``request_id`` at every poll
    (a stop for a request the loop no longer holds is ignored)."""

    def __init__(self, request_id: str):
        self.request_id = request_id

    def take(self) -> list[tuple[str, str]]:
        return [(self.request_id, "k")]

    def close(self):
        pass


def handed_off(context, side, rid, prompt, params):
    """Prefill ``prompt`` on the context engine: its first token, and the generation_only
    request with the KV ``side`` fetches for it."""
    (result,) = context.prefill_only([(rid, prompt, params)])
    request = EngineRequest(prompt + [result.token_id], params, streaming=False)
    handle = CopyHandle(result.num_tokens, result.block_ids, rid)
    return result.token_id, request, FetchedKV(side.connector, handle)



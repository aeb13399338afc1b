"""The context role's prefill pass: prefill admitted prompts in one engine pass and hand
each one's KV off.

The instance's loop (:mod:`triton_disagg.context.prefill_loop`) admits waiting prompts from
the engine's queue once their blocks (and the KV handoff's room) are free, and gives
:meth:`Prefiller.prefill` the sequences holding them; :meth:`LLMEngine.prefill_reserved`
fills them. Each result is the first token plus ``context_phase_params`` (empty when the
first token already finished the request: its blocks are freed, nothing is handed off).

Invariants: only the loop's thread calls in here (it owns the engine and its pool, so
nothing locks); one request's mistake fails only that request (a batch whose prefill fails
is retried one request at a time); a prefill that fails gives every block it took back (or
ends the lease that took it), and each request then gets its own result or error (a fault:
``EngineError``, INTERNAL), never an exception out of :meth:`Prefiller.prefill`; every
result either carries a handle that owns its blocks or has no blocks (the KV connector,
:mod:`triton_disagg.kv.connector`, frees them exactly once, as messages to the loop).

An overlapped request (``--overlap_kv_transfer``: it carries generation's ``kv_listener``)
has its blocks leased before the prefill writes them, and generation hears of the handle,
of each layer as it lands, and of the first token (:class:`~triton_disagg.kv.overlap.Announcer`,
sent from the loop's thread); one whose announcement fails gives its KV back and fails alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from triton_disagg import protocol as P
from triton_disagg.engine.llm_engine import LLMEngine, PrefillResult
from triton_disagg.engine.sequence import Sequence
from triton_disagg.errors import EngineError, RequestError, Unavailable
from triton_disagg.kv.connector import ConnectorError, HandoffBusy, KVConnector
from triton_disagg.kv.handle import HandleError
from triton_disagg.triton import tensors

if TYPE_CHECKING:
    from triton_disagg.kv.overlap import Announcer

_log = logging.getLogger(__name__)


class Prefiller:
    """``engine``'s prefill passes and ``connector``'s exports (the loop's thread alone);
    ``reclaim()`` takes back into the pool the blocks the connector freed meanwhile (the
    loop's frees queue), so that a failed batch's requests can each take theirs again."""

    def __init__(self, engine: LLMEngine, connector: KVConnector,
                 reclaim: Callable[[], None]):
        self.engine, self.connector, self.reclaim = engine, connector, reclaim

    def prefill(self, seqs: list[Sequence], listeners: dict[str, bytes]) -> list[dict | Exception]:
        """Engine outputs plus ``context_phase_params`` per admitted sequence (in order), or
        that request's error; ``listeners``: generation's ``kv_listener`` of each overlapped
        request, by request id."""
        try:
            results: list = self._prefill(seqs, listeners)
        except Exception as exc:  # noqa: BLE001 - the blocks went back; each request tries alone
            results = ([self._one(seq, listeners) for seq in seqs] if len(seqs) > 1
                       else [_refusal(exc)])
        answers = [self._hand_off(r) if not isinstance(r, Exception) else r for r in results]
        for seq, answer in zip(seqs, answers):   # one line per request
            done = "handed off" + (" (overlapped)" if seq.request_id in listeners else "")
            _log.info("prefill of %d prompt tokens: %s", len(seq.prompt_ids),
                      answer if isinstance(answer, Exception) else done,
                      extra={"request_id": seq.request_id})
        return answers

    def _one(self, seq: Sequence, listeners: dict[str, bytes]
             ) -> PrefillResult | _Overlapped | Exception:
        """``seq``'s request alone, in blocks of its own again (its batch's went back)."""
        try:
            self.reclaim()
            again = self.engine.reserve_prompts([(seq.request_id, seq.prompt_ids, seq.params)])
            return self._prefill(again, listeners)[0]
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            return _refusal(exc)

    def _prefill(self, seqs: list[Sequence], listeners: dict[str, bytes]
                 ) -> list[PrefillResult | _Overlapped | Exception]:
        """Each sequence's PrefillResult (an overlapped one's as an _Overlapped), or error."""
        overlapped: dict[str, _Overlapped] = {}
        try:
            for s in seqs:
                if listeners.get(s.request_id):
                    overlapped[s.request_id] = _Overlapped.begin(self, s,
                                                                 listeners[s.request_id])
            failed = {rid: o.error for rid, o in overlapped.items() if o.error is not None}
            kept = [s for s in seqs if s.request_id not in failed]
            live = [o for o in overlapped.values() if o.error is None]

            def on_layer(li: int) -> None:
                for o in live:
                    o.layers(li + 1)

            results = self.engine.prefill_reserved(kept, on_layer if live else None,
                                                   frozenset(overlapped))
        except BaseException as exc:
            self._give_back(seqs, overlapped, exc)
            raise
        done = {r.request_id: (overlapped[r.request_id].landed(r)
                               if r.request_id in overlapped else r) for r in results}
        return [failed.get(s.request_id) or done[s.request_id] for s in seqs]

    def _give_back(self, seqs: list[Sequence], overlapped: dict[str, "_Overlapped"],
                   exc: BaseException) -> None:
        """A prefill failed: free the blocks of ``seqs`` that no handoff owns, and end the
        leases of the overlapped ones that took theirs (those that failed earlier gave
        theirs back then)."""
        for seq in seqs:
            if seq.request_id not in overlapped:
                seq.block_table.release(self.engine.pool)
        for o in overlapped.values():
            if o.error is None:
                try:
                    o.fail(RequestError(f"the prefill failed: {type(exc).__name__}: {exc}"))
                except Exception:  # noqa: BLE001 - the other leases still end
                    _log.exception("giving back the KV of %s failed", o.request_id)

    def _hand_off(self, result: PrefillResult | _Overlapped) -> dict | Exception:
        if isinstance(result, _Overlapped):
            return result.outputs()
        out = tensors.prefill_outputs(result)
        handle = b""
        if result.block_ids:
            try:
                handle = self.connector.export(result.block_ids, result.num_tokens)
            except Exception as exc:  # noqa: BLE001 - e.g. a handle too large: this request fails
                return _handoff_error(exc)
        out[P.CONTEXT_PHASE_PARAMS] = np.frombuffer(handle, dtype=np.uint8)
        return out


def _handoff_error(exc: Exception) -> Exception:
    """A KV handoff that failed, as the request's error: a handle too large for its prompt
    is the request's (INVALID_ARG); no room now is UNAVAILABLE; anything else (a transport
    or a device copy that failed) is a fault of the server (INTERNAL), not the client's."""
    if isinstance(exc, HandleError):
        return RequestError(f"KV handoff failed: {exc}")
    if isinstance(exc, HandoffBusy):
        return Unavailable(f"KV handoff failed: {exc}")
    _log.error("KV handoff failed", exc_info=exc)
    return EngineError(f"KV handoff failed: {type(exc).__name__}: {exc}")


def _refusal(exc: Exception) -> RequestError | EngineError:
    """A request's error: its own mistake is its RequestError, anything else a fault
    (logged, INTERNAL)."""
    if isinstance(exc, RequestError):
        return RequestError(str(exc))
    _log.error("prefill failed", exc_info=exc)
    return EngineError(f"prefill failed: {type(exc).__name__}: {exc}")


@dataclass
class _Overlapped:
    """One overlapped request through the prefill: its announcer, the handle that leased its
    blocks, and its error (it then fails alone; its KV goes back with the lease).

    Generation that cannot be reached (its agent refuses the connection or a notification)
    is not this request's mistake: the announcer is dropped and the request goes on as an
    ordinary handoff, whose handle the orchestrator holds; a generation server that cannot
    be reached is lost, and the orchestrator moves the request to another."""

    prefiller: Prefiller
    request_id: str
    blocks: list[int]
    announcer: Announcer | None = None
    handle: bytes = b""
    error: Exception | None = None
    result: PrefillResult | None = None    # the prefill's, once it landed
    staged: int = 0          # layers of a device KV copied to the host array so far

    @classmethod
    def begin(cls, prefiller: Prefiller, seq: Sequence, listener: bytes) -> "_Overlapped":
        """Lease ``seq``'s reserved blocks (not yet written) and send generation the handle."""
        overlapped = cls(prefiller, seq.request_id, list(seq.block_table.block_ids))
        return overlapped.announce(listener, len(seq.prompt_ids))

    def announce(self, listener: bytes, prompt_length: int) -> "_Overlapped":
        """Reach generation's ``listener``, lease the blocks and send it their handle; a bad
        listener or a failed export fails this request alone (unreachable generation: an
        ordinary handoff, see the class docstring)."""
        try:
            self.announcer = self.prefiller.connector.announcer(listener)
        except ConnectorError as exc:
            self._unheard(exc)
        except Exception as exc:  # noqa: BLE001 - a bad listener fails this request alone
            self.prefiller.engine.pool.free(self.blocks)
            self.error = RequestError(f"kv_listener: {exc}")
            return self
        try:
            self.handle = self.prefiller.connector.export(self.blocks, prompt_length,
                                                          prefilling=True)
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            self.fail(_handoff_error(exc))
        else:
            self._tell(lambda a: a.handle(self.handle))
        return self

    def layers(self, done: int) -> None:
        """Layers ``0..done-1`` are final: copy a device KV's new ones to the host array,
        restart the lease (a long prefill must not outlast it while it still makes
        progress) and tell generation."""
        if self.error is None:
            try:
                self._stage(done)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                self.fail(_handoff_error(exc))
                return
            self.prefiller.connector.renew(self.handle)
            self._tell(lambda a: a.layers(done))

    def _stage(self, done: int) -> None:
        self.prefiller.connector.stage(self.blocks, range(self.staged, done))
        self.staged = done

    def landed(self, result: PrefillResult) -> "_Overlapped | Exception":
        """The prefill ended: the first token goes to generation (every layer is in place),
        or, if it finished the request, the KV goes back and generation is told so."""
        self.result = result
        if self.error is None and result.finish_reason is not None:
            self.fail(None, f"the request finished at its first token ({result.finish_reason})")
        elif self.error is None:
            try:
                self._stage(self.prefiller.connector.geometry.num_layers)
                # final: the lease runs from now
                self.prefiller.connector.renew(self.handle, prefilling=False)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                self.fail(_handoff_error(exc))
            else:
                self._tell(lambda a: a.first(result.token_id, result.logprob))
        return self.error if self.error is not None else self

    def outputs(self) -> dict:
        """The context's answer (after :meth:`landed`): the first token and the handle."""
        r = self.result
        assert r is not None, "outputs() follows landed()"
        out = tensors.prefill_outputs(r)
        handle = self.handle if r.finish_reason is None else b""
        out[P.CONTEXT_PHASE_PARAMS] = np.frombuffer(handle, dtype=np.uint8)
        return out

    def _tell(self, say: Callable[[Announcer], None]) -> None:
        """``say(announcer)``, unless generation was found unreachable before."""
        if self.announcer is not None:
            try:
                say(self.announcer)
            except ConnectorError as exc:
                self._unheard(exc)

    def _unheard(self, exc: Exception) -> None:
        _log.warning("generation cannot be reached for the overlapped KV handoff (%s); the "
                     "request goes on as an ordinary handoff", exc,
                     extra={"request_id": self.request_id})
        self.announcer = None

    def fail(self, error: Exception | None, reason: str = "") -> None:
        """Give the KV back (the lease, if it was taken) and tell generation why."""
        self.error = error
        if self.handle:
            self.prefiller.connector.release(self.handle)
        if self.announcer is not None:
            self.announcer.failed(reason or str(error))

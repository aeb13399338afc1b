"""``--overlap_kv_transfer``: generation READs a prompt's KV layer by layer while the
context still prefills it, and starts decoding as soon as the last layer and the first
token have landed (``direct_transfer`` only: it needs NIXL READs of the context's pool).

The request reaches generation first (``generation_awaiting_context``): generation answers
with a signed listener (:mod:`~triton_disagg.kv.overlap_wire`: its agent's contact and a
nonce), queues the sequence as any request, and tells the orchestrator once its queue gave
the sequence its blocks (an event with no tokens). Only then does the orchestrator hand the
listener to the context with the prompt, so the context never holds KV that generation has
no blocks for (the two queues, in different orders, would otherwise wait on each other).
The context leases the prompt's blocks *before* its prefill (:class:`Announcer`: the handle goes to generation
at once), tells generation as each layer's KV is final, and finally the first token.
Generation's :class:`~triton_disagg.kv.layer_reader.LayerReader` READs each newly final
layer range straight into the sequence's blocks, then the ticket words (the ordinary
lease check of :mod:`~triton_disagg.kv.nixl`, which ends the lease), and reports
the transfer done with the first token: the sequence joins the batch without the
context's answer travelling through the orchestrator.

Trust: generation exposes no memory (the contact holds no keys) and only READs, as in an
ordinary fetch; the context writes nothing into generation. A notification is acted on
only with the request's nonce, and the KV only under a handle signed by the deployment
key, checked like any other (engine, layout, strategy, single use).

Invariants: every pull ends, by its deadline at the latest, and each notification is
handled on its own (:mod:`~triton_disagg.kv.layer_reader` states how); an announcement
the context cannot send raises :class:`ConnectorError`, except :meth:`Announcer.failed`,
which is best effort.

This module holds the context's side, :class:`Announcer`; generation's reader is in
:mod:`~triton_disagg.kv.layer_reader`, the signed listener and the notifications' wire
format in :mod:`~triton_disagg.kv.overlap_wire`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from triton_disagg.kv import overlap_wire as wire
from triton_disagg.kv.connector import ConnectorError

if TYPE_CHECKING:
    from triton_disagg.kv.nixl import NixlEndpoint

_log = logging.getLogger(__name__)


class Announcer:
    """The context's side of one overlapped request: notifications to the generation agent
    the ``listener`` names, through ``endpoint``'s agent. Every call raises
    :class:`ConnectorError` if NIXL cannot send."""

    def __init__(self, endpoint: "NixlEndpoint", listener: wire.Listener):
        self.agent, self.nonce = endpoint.agent, listener.nonce
        self.peer = self.agent.connect(listener.agent_name, listener.contact)

    def handle(self, data: bytes) -> None:
        self._send(wire.HANDLE, data)

    def layers(self, done: int) -> None:
        self._send(wire.LAYERS, str(done).encode())

    def first(self, token: int, logprob: float | None) -> None:
        self._send(wire.FIRST, f"{int(token)} {float(logprob or 0.0)!r}".encode())

    def failed(self, reason: str) -> None:
        """Best effort: a context that cannot reach generation leaves it to its deadline."""
        try:
            self._send(wire.FAILED, reason.encode()[:wire.MAX_REASON])
        except ConnectorError as exc:
            _log.warning("overlapped KV: could not tell generation %s failed (%s)",
                         self.peer, exc)

    def _send(self, kind: bytes, payload: bytes) -> None:
        self.agent.notify(self.peer, wire.message(kind, self.nonce, payload))

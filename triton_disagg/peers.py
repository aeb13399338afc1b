"""Who may call the context and generation models: the deployment's own orchestrators.

Every request an orchestrator sends to ``context`` or ``generation`` (BLS in ``serve
all``, gRPC from a scheduler; release calls included) carries the request parameter
``peer_credential``: a value derived from the deployment secret
(:mod:`triton_disagg.kv.secret`), which only the deployment's servers hold. Both models
refuse a request without it, before they read its tensors, so a client that reaches
Triton's endpoints (in ``serve all`` the public repository also holds ``context`` and
``generation``) gets neither a prefill, nor a ``context_phase_params`` handle, nor a
decode stream. Servers of one deployment on several hosts therefore share the secret
(``TRITON_DISAGG_KV_SECRET``), in aggregated mode too.

Invariants: the credential is an HMAC of a fixed label under the deployment key, so it
reveals nothing of the key and differs from every other value derived from it (handle
tags, key ids, ZeroMQ keys); :func:`check` compares in constant time and its refusal
names what is missing, never the expected value. It is a bearer value: whoever reads
it on the wire (gRPC between the roles is plaintext) can present it.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from triton_disagg import protocol as P
from triton_disagg.errors import RequestError
from triton_disagg.kv.secret import SECRET_ENV, deployment_key

PARAMETER = P.PEER_CREDENTIAL
_LABEL = b"triton-disagg peer credential v1"


def credential() -> str:
    """This deployment's peer credential (what an orchestrator presents); reads the secret,
    so callers keep it for their lifetime."""
    return hmac.new(deployment_key(), _LABEL, hashlib.sha256).hexdigest()


def check(parameters: str | dict | None, model: str, expected: str) -> None:
    """Raise :class:`RequestError` unless a request's ``parameters`` (Triton's JSON string
    or a dict) carry ``expected`` (this deployment's :func:`credential`)."""
    params = parameters if isinstance(parameters, dict) else json.loads(parameters or "{}")
    presented = params.get(PARAMETER)
    if not isinstance(presented, str) or not hmac.compare_digest(
            presented.encode(), expected.encode()):
        raise RequestError(f"the {model} model answers only this deployment's orchestrators "
                           f"(request parameter {PARAMETER!r} missing or wrong: clients call "
                           f"the ensemble; servers of one deployment share {SECRET_ENV})")

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

Who may call the ``orchestrator`` model: the ensemble and the HTTP front, which both
prepare a request with :class:`~triton_disagg.front.tokenizer.Preprocessor`. It seals its
outputs: the tensor ``preprocessed`` (:func:`seal`) is an HMAC, under a key derived from the
deployment secret (:func:`seal_key`), of the tensors it produced (:data:`SEALED`). The
orchestrator refuses a request whose seal is missing or does not match its tensors
(:func:`check_seal`), so a client that calls it directly cannot choose ``input_ids`` or the
word lists; a client that calls ``preprocessing`` itself gets a seal valid only for what
preprocessing produced from its text, which it could have sent through the ensemble.
"""

from __future__ import annotations

import hashlib
import hmac
import json

import numpy as np

from triton_disagg import protocol as P
from triton_disagg.errors import RequestError
from triton_disagg.kv.secret import SECRET_ENV, deployment_key

PARAMETER = P.PEER_CREDENTIAL
_LABEL = b"triton-disagg peer credential v1"
_SEAL_LABEL = b"triton-disagg preprocessed seal v1"
# What preprocessing produces and the orchestrator checks (its other inputs are the client's
# sampling options, which the orchestrator bounds itself).
SEALED = ("input_ids", "input_lengths", "request_output_len", "stop_words_list",
          "bad_words_list", "end_id", "pad_id")


def credential() -> str:
    """This deployment's peer credential (what an orchestrator presents); reads the secret,
    so callers keep it for their lifetime."""
    return hmac.new(deployment_key(), _LABEL, hashlib.sha256).hexdigest()


def check(parameters: str | dict | None, model: str, expected: str) -> None:
    """Raise :class:`RequestError` unless a request's ``parameters`` (Triton's JSON string
    or a dict) carry ``expected`` (this deployment's :func:`credential`)."""
    params = parameters if isinstance(parameters, dict) else json.loads(parameters or "{}")
    presented = params.get(PARAMETER) if isinstance(params, dict) else None
    if not isinstance(presented, str) or not hmac.compare_digest(   # a lone surrogate too
            presented.encode("utf-8", "surrogatepass"), expected.encode()):
        raise RequestError(f"the {model} model answers only this deployment's orchestrators "
                           f"(request parameter {PARAMETER!r} missing or wrong: clients call "
                           f"the ensemble; servers of one deployment share {SECRET_ENV})")


def seal_key() -> bytes:
    """The key of :func:`seal` (derived from the deployment secret; reads it)."""
    return hmac.new(deployment_key(), _SEAL_LABEL, hashlib.sha256).digest()


def seal(tensors: dict[str, np.ndarray], key: bytes) -> np.ndarray:
    """The seal of ``tensors`` (the :data:`SEALED` ones, batch axis removed): UINT8 [32]."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for name in SEALED:
        array = np.ascontiguousarray(tensors[name], dtype=np.int32)
        mac.update(f"{name}{list(array.shape)}".encode())
        mac.update(array.tobytes())
    return np.frombuffer(mac.digest(), dtype=np.uint8)


def check_seal(inputs: dict[str, np.ndarray], key: bytes) -> None:
    """Raise :class:`RequestError` unless ``inputs`` carry :data:`SEALED` and their seal."""
    presented = inputs.get(P.PREPROCESSED)
    missing = [name for name in SEALED if name not in inputs]
    if (presented is None or missing or np.size(presented) != 32
            or not hmac.compare_digest(np.asarray(presented, np.uint8).tobytes(),
                                       seal(inputs, key).tobytes())):
        raise RequestError(f"the orchestrator model takes only requests prepared by this "
                           f"deployment's preprocessing (tensor {P.PREPROCESSED!r} missing or "
                           f"not matching the request's tensors): clients call the ensemble "
                           f"or the HTTP front")

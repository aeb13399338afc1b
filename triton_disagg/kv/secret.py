"""The deployment secret: the HMAC key that signs ``context_phase_params`` (:mod:`.handle`).

Source: the environment variable ``TRITON_DISAGG_KV_SECRET`` (at least 32 characters,
e.g. ``openssl rand -hex 32``). Rendering a repository without it generates one and
exports it into the rendering process's environment, which the ``tritonserver`` it
starts and the model stubs inherit: enough for ``serve all``, where one render holds
both models. Roles served alone (``serve context`` / ``serve generation``, maybe on
different hosts) must be given the same value, or generation refuses every handle
("not signed by this deployment").

Invariants: the secret is never written into the model repository (Triton answers
``GET /v2/models/<model>/config`` with the rendered settings to any client) nor
logged; the settings carry only its key id, a hash that does not reveal it, and a
model refuses to start with a secret other than the one its repository was rendered
for.
"""

from __future__ import annotations

import hashlib
import os
import secrets

from triton_disagg.errors import UserError

SECRET_ENV = "TRITON_DISAGG_KV_SECRET"
MIN_CHARS = 32


def render_key_id() -> str:
    """The key id for a repository rendered now; generates the secret if it is unset."""
    secret = os.environ.get(SECRET_ENV)
    if secret is None:
        secret = os.environ[SECRET_ENV] = secrets.token_hex(32)
    return key_id(_key(secret))


def load_key(settings: dict) -> bytes:
    """The HMAC key from the environment, checked against the rendered ``kv_key_id``."""
    secret = os.environ.get(SECRET_ENV)
    if secret is None:
        raise UserError(f"{SECRET_ENV} is not set in the server's environment; start it with "
                        f"`triton-disagg serve`, or export the secret the repository was "
                        f"rendered with")
    key = _key(secret)
    if key_id(key) != settings["kv_key_id"]:
        raise UserError(f"{SECRET_ENV} is not the secret this model repository was rendered "
                        f"with (key id {key_id(key)}, rendered for {settings['kv_key_id']}); "
                        f"render again or start with that secret")
    return key


def key_id(key: bytes) -> str:
    """A public name for a key: tells two keys apart without revealing either."""
    return hashlib.sha256(b"triton-disagg kv key id\0" + key).hexdigest()[:16]


def _key(secret: str) -> bytes:
    if len(secret) < MIN_CHARS:
        raise UserError(f"{SECRET_ENV} has {len(secret)} characters; use at least {MIN_CHARS} "
                        f"random ones (e.g. `openssl rand -hex 32`)")
    return secret.encode()

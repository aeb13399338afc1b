"""The deployment secret: the HMAC key that signs ``context_phase_params`` (:mod:`.handle`).

Source, first found: the environment variable ``TRITON_DISAGG_KV_SECRET`` (at least 32
characters, e.g. ``openssl rand -hex 32``); else the user's secret file
``$XDG_CONFIG_HOME/triton-disagg/kv_secret`` (``~/.config/...``), which the first render
on a host creates with 64 random hex digits, readable by the user alone. So every server
one user starts on one host (``serve all``, or the three roles apart) shares a key, as
Erlang nodes share ``~/.erlang.cookie``; servers on different hosts need the variable
(or the file) set to the same value, or generation refuses every handle ("not signed
by this deployment").

Invariants: the secret is never written into the model repository (Triton answers
``GET /v2/models/<model>/config`` with the rendered settings to any client) nor
logged; the settings carry only its key id, a hash that does not reveal it, and a
model refuses to start with a secret other than the one its repository was rendered
for. The file appears whole or not at all (written aside, then hard-linked into place),
so servers starting together read one value.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from triton_disagg.errors import UserError

SECRET_ENV = "TRITON_DISAGG_KV_SECRET"
MIN_CHARS = 32


def secret_file() -> Path:
    config_home = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config_home) / "triton-disagg" / "kv_secret"


def deployment_key() -> bytes:
    """The HMAC key: the variable's value, else the secret file's (created if missing)."""
    secret = os.environ.get(SECRET_ENV)
    if secret is None:
        path = secret_file()
        try:
            if not path.exists():
                _create(path)
            secret = path.read_text().strip()
        except OSError as exc:
            raise UserError(f"cannot keep the KV secret in {path} ({exc.strerror}); set "
                            f"{SECRET_ENV} (e.g. `openssl rand -hex 32`)") from None
    if len(secret) < MIN_CHARS:
        raise UserError(f"the KV secret ({SECRET_ENV} or {secret_file()}) has {len(secret)} "
                        f"characters; use at least {MIN_CHARS} random ones "
                        f"(e.g. `openssl rand -hex 32`)")
    return secret.encode()


def render_key_id() -> str:
    """The key id a repository rendered now records in its settings."""
    return key_id(deployment_key())


def load_key(rendered_key_id: str | None) -> bytes:
    """The HMAC key, checked against the key id the repository was rendered with
    (settings' ``kv_key_id``)."""
    key = deployment_key()
    if key_id(key) != rendered_key_id:
        raise UserError(f"the KV secret ({SECRET_ENV} or {secret_file()}) is not the one this "
                        f"model repository was rendered with (key id {key_id(key)}, rendered "
                        f"for {rendered_key_id}); render again or restore that secret")
    return key


def key_id(key: bytes) -> str:
    """A public name for a key: tells two keys apart without revealing either."""
    return hashlib.sha256(b"triton-disagg kv key id\0" + key).hexdigest()[:16]


def _create(path: Path) -> None:
    """Write a fresh secret to ``path`` unless another process got there first."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    aside = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
        os.link(aside, path)
    except FileExistsError:
        pass                                    # another server created it: use theirs
    finally:
        aside.unlink()

"""The deployment secret: the HMAC key that signs ``context_phase_params`` (:mod:`.handle`).

Source, first found: the environment variable ``TRITON_DISAGG_KV_SECRET`` (at least 32
characters, e.g. ``openssl rand -hex 32``); else the user's secret file
``$XDG_CONFIG_HOME/triton-disagg/kv_secret`` (``~/.config/...``), which the first render
on a host creates with 64 random hex digits, readable by the user alone (a file that
group or others may read or write, or that another user owns, is refused). So every server
one user starts on one host (``serve all``, or the three roles apart) shares a key, as
Erlang nodes share ``~/.erlang.cookie``; servers on different hosts need the variable
(or the file) set to the same value, or generation refuses every handle ("not signed
by this deployment").

Invariants: the secret is never written into the model repository (Triton answers
``GET /v2/models/<model>/config`` with the rendered settings to any client) nor
logged; the settings carry only its key id, a salted, deliberately slow (scrypt) digest
that neither reveals it nor lets it be guessed offline at speed, and a
model refuses to start with a secret other than the one its repository was rendered
for. The file appears whole or not at all (written aside, then hard-linked into place),
so servers starting together read one value.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
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
            _check_private(path)
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


@functools.lru_cache(maxsize=8)
def key_id(key: bytes) -> str:
    """A public name for a key: tells two keys apart without revealing either. Salted and
    scrypt-stretched (about 50 ms), so that the published id is no fast oracle for guessing
    the secret offline."""
    return hashlib.scrypt(key, salt=b"triton-disagg kv key id", n=1 << 14, r=8, p=1,
                          dklen=8).hex()


def _check_private(path: Path) -> None:
    """UserError unless ``path`` is owned by this user and closed to group and others."""
    info = path.stat()
    if info.st_uid != os.getuid():
        raise UserError(f"the KV secret file {path} is owned by uid {info.st_uid}, not by this "
                        f"user (uid {os.getuid()}); remove it (a new one is made) or "
                        f"`chown $USER {path} && chmod 600 {path}`")
    if info.st_mode & 0o077:
        raise UserError(f"the KV secret file {path} has mode "
                        f"{stat.S_IMODE(info.st_mode):04o}: group or others may read or write "
                        f"it; run `chmod 600 {path}`")


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

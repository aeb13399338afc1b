"""``context_phase_params`` comes from the network: a handle that was not signed by this
deployment, names a path outside the staging area, or is huge or deeply nested is a
:class:`HandleError` (a per-request error), never anything else; the secret that signs
handles is shared by one deployment's models and never written into its repository."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import struct
import time

import pytest

from triton_disagg.config.disagg import parse_config
from triton_disagg.errors import UserError
from triton_disagg.kv import secret
from triton_disagg.kv.handle import (FORMAT_VERSION, MAX_BLOCK_ID, MAX_LEASE_SECONDS, HandleError,
                                     KVHandle, check_handle, decode, encode)
from triton_disagg.kv.layout import BlockGeometry
from triton_disagg.triton.render import render, settings

FP = "f" * 64
KEY = b"k" * 32


def _staged(**overrides) -> KVHandle:
    fields = dict(fingerprint=FP, geometry=BlockGeometry(2, 2, 4, 4, "float32"), num_tokens=5,
                  strategy="host_memory", lease_id="ab12", lease_seconds=5,
                  shm_name="triton_disagg_kv_1-23-45_context_0_0_0a1b2c3d", slots=(0, 1))
    return KVHandle(**{**fields, **overrides})


def _direct(**overrides) -> KVHandle:
    fields = dict(strategy="direct_transfer", agent_name="ctx-1", agent_metadata=b"\x00md",
                  pool_addr=4096, ticket_addr=8192, ticket=7, block_ids=(3, 1), shm_name="",
                  slots=())
    return _staged(**{**fields, **overrides})


def _signed(header: bytes, tail: bytes = b"", key: bytes = KEY) -> bytes:
    """A handle made of ``header`` as if a context server holding ``key`` had signed it."""
    body = struct.pack(">4sHI", b"TDKV", FORMAT_VERSION, len(header)) + header + tail
    return body + hmac.new(key, body, hashlib.sha256).digest()


def test_tampered_or_unsigned_handle_is_not_signed_by_this_deployment():
    good = encode(_direct(), KEY)
    assert decode(good, KEY) == _direct()
    forged = encode(_direct(pool_addr=1 << 40), b"x" * 32)          # another deployment's key
    for bad in (good.replace(b'"pool_addr":4096', b'"pool_addr":4097'), good[:-32],
                good[:-1] + bytes([good[-1] ^ 1]), forged):
        with pytest.raises(HandleError, match="not signed by this deployment"):
            decode(bad, KEY)


@pytest.mark.parametrize("name", ["../../etc/passwd", "triton_disagg_kv_x/../../tmp/y", "..",
                                  "a/b", "kv x", "", "kv\x00", "x" * 256])
def test_shm_name_outside_the_staging_area_is_refused(name):
    fields = dataclasses.asdict(_staged())
    del fields["agent_metadata"]
    fields["shm_name"] = name
    with pytest.raises(HandleError, match="shm_name"):     # even when signed
        decode(_signed(json.dumps(fields).encode()), KEY)
    with pytest.raises(ValueError, match="shm_name"):
        _staged(shm_name=name)


def test_deeply_nested_header_is_a_handle_error_signed_or_not():
    header = b"[" * 30_000 + b"]" * 30_000
    with pytest.raises(HandleError, match="not signed"):
        decode(_signed(header, key=b"x" * 32), KEY)
    with pytest.raises(HandleError, match="corrupt"):
        decode(_signed(header), KEY)


def test_huge_handle_is_refused_before_parsing():
    with pytest.raises(HandleError, match="larger than"):
        decode(_signed(b"{}", b"m" * (1 << 20)), KEY)
    with pytest.raises(HandleError, match="over the 65536-byte limit"):
        encode(_direct(agent_metadata=b"m" * (64 << 10)), KEY)


@pytest.mark.parametrize("change", [
    {"geometry": [1, 2]}, {"num_tokens": True}, {"block_ids": ["1", 2]}, {"extra": 1},
    {"lease_seconds": "soon"}, {"lease_seconds": -1}, {"ticket": 0}])
def test_wrong_fields_in_a_signed_header_are_handle_errors(change):
    fields = dataclasses.asdict(_direct())
    del fields["agent_metadata"]
    with pytest.raises(HandleError, match="corrupt"):
        decode(_signed(json.dumps({**fields, **change}).encode(), b"md"), KEY)


def test_one_secret_per_user_and_host_or_from_the_environment_never_in_the_repository(
        monkeypatch, tmp_path):
    (tmp_path / "engine.json").write_text("{}")
    config = parse_config({"model": {"engine": str(tmp_path)},
                           "kv_cache": {"strategy": "direct_transfer"}})
    monkeypatch.setenv(secret.SECRET_ENV, "x" * 32)    # so that teardown restores the original
    monkeypatch.delenv(secret.SECRET_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    repo = render("all", config, tmp_path / "repo")                  # creates the file
    path = tmp_path / "cfg" / "triton-disagg" / "kv_secret"
    generated = path.read_text().strip()
    assert len(generated) == 64 and path.stat().st_mode & 0o777 == 0o600
    ids = {settings(m, role, config).kv_key_id                    # roles rendered apart agree
           for m in ("context", "generation") for role in ("all", m)}
    assert ids == {secret.key_id(generated.encode())}
    rendered = "".join(p.read_text() for p in repo.rglob("*") if p.is_file())
    assert generated not in rendered and next(iter(ids)) in rendered
    assert secret.load_key(settings("generation", "all", config).kv_key_id) == generated.encode()
    monkeypatch.setenv(secret.SECRET_ENV, "s" * 40)                  # the variable wins
    assert settings("context", "context", config).kv_key_id == secret.key_id(b"s" * 40)
    with pytest.raises(UserError, match="not the one this model repository was rendered"):
        secret.load_key(next(iter(ids)))
    monkeypatch.setenv(secret.SECRET_ENV, "short")
    with pytest.raises(UserError, match="at least 32"):
        settings("context", "context", config)
    monkeypatch.delenv(secret.SECRET_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "engine.json"))  # not a directory
    with pytest.raises(UserError, match=f"cannot keep the KV secret.*set {secret.SECRET_ENV}"):
        settings("context", "context", config)


def test_secret_file_open_to_group_or_others_is_refused_naming_chmod(monkeypatch, tmp_path):
    monkeypatch.setenv(secret.SECRET_ENV, "x" * 32)    # so that teardown restores the original
    monkeypatch.delenv(secret.SECRET_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    secret.deployment_key()                                          # creates it, mode 600
    path = secret.secret_file()
    for mode in (0o640, 0o604, 0o620, 0o602):
        path.chmod(mode)
        with pytest.raises(UserError, match=f"mode {mode:04o}.*run `chmod 600 {path}`"):
            secret.deployment_key()
    path.chmod(0o600)
    assert len(secret.deployment_key()) == 64
    if os.getuid() == 0:                                 # only root can give it away
        os.chown(path, 4242, -1)
        with pytest.raises(UserError, match="owned by uid 4242, not by this user"):
            secret.deployment_key()


def test_published_key_id_is_slow_to_compute_so_no_offline_guessing_oracle():
    """The key id is public (model config); a fast unsalted hash of the secret would let
    anyone test guesses at it offline at billions a second."""
    key = secrets.token_bytes(32)
    start = time.perf_counter()
    kid = secret.key_id(key)
    assert time.perf_counter() - start > 0.01
    assert kid not in hashlib.sha256(b"triton-disagg kv key id\0" + key).hexdigest()
    assert secret.key_id(key) == kid and secret.key_id(b"k" * 32) != kid


@pytest.mark.parametrize("field, value, words", [
    ("lease_seconds", 1e12, "lease_seconds in"), ("lease_seconds", MAX_LEASE_SECONDS + 1, "lease"),
    ("block_ids", [MAX_BLOCK_ID, 1], "block_ids must be in"), ("block_ids", [10**40, 1], "block_ids"),
    ("slots", [0, MAX_BLOCK_ID], "slots must be in"),
])
def test_a_signed_handle_with_unbounded_numbers_is_refused_at_parse(field, value, words):
    made = _direct() if field == "block_ids" else _staged()
    header = json.loads(encode(made, KEY)[10:10 + int.from_bytes(encode(made, KEY)[6:10], "big")])
    header[field] = value
    tail = made.agent_metadata
    with pytest.raises(HandleError, match=words):
        decode(_signed(json.dumps(header).encode(), tail), KEY)


def test_a_handle_over_the_receivers_pool_is_refused():
    handle = _staged(num_tokens=4097, slots=tuple(range(1025)))       # 4 tokens per block
    with pytest.raises(HandleError, match="4097 tokens of KV, more than .* holds \\(4096\\)"):
        check_handle(handle, FP, handle.geometry, 4096)
    check_handle(_staged(), FP, _staged().geometry, 4096)


def test_the_config_refuses_a_lease_no_handle_may_carry(tmp_path):
    (tmp_path / "engine.json").write_text("{}")
    with pytest.raises(UserError, match="lease_seconds: 7200 is over 3600"):
        parse_config({"model": {"engine": str(tmp_path)}, "kv_cache": {"lease_seconds": 7200}})

"""The config's ``discovery`` section (etcd membership): its dataclass and its parser.

Invariant: a :class:`DiscoveryConfig` the parser returns names etcd's client endpoint
as host:port, a key prefix starting with ``/`` (no trailing ``/``), a ttl of whole seconds
>= 2, TLS files resolved to absolute paths (present, when checked on this host), and
user and password variable both or neither.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
# Any here: parsed YAML values, checked where they are read.

from triton_disagg.config.values import mapping, parse_url, pem_file
from triton_disagg.errors import UserError

_DISCOVERY_KEYS = {"etcd", "prefix", "ttl_seconds", "ca_file", "cert_file", "key_file",
                   "username", "password_env"}
_DISCOVERY_FILES = ("ca_file", "cert_file", "key_file")


@dataclass(frozen=True)
class DiscoveryConfig:
    """etcd membership: servers register under ``prefix`` with a lease of
    ``ttl_seconds`` (whole seconds, >= 2: etcd counts leases in seconds and rounds
    shorter ones up).

    TLS: with ``ca_file`` or ``cert_file`` the client speaks https, verifying etcd's
    certificate against ``ca_file`` (else the system's CAs) and presenting ``cert_file`` /
    ``key_file`` (always both) when given. Auth: ``username`` with the password read from
    the environment variable ``password_env`` (always both; the password itself is never in
    the config, which lands in ConfigMaps and Triton's model settings). ``kv_budget`` is
    not a user key: the parser fills it from the config (``triton_disagg.config.disagg``)."""

    etcd: str                           # "host:port" of etcd's client endpoint
    prefix: str = "/triton-disagg"      # starts with "/", no trailing "/"
    ttl_seconds: int = 10
    ca_file: str | None = None          # absolute paths (relative ones resolve against the config)
    cert_file: str | None = None
    key_file: str | None = None
    username: str | None = None
    password_env: str | None = None
    # role -> KV bytes one server of that role holds at most, by this config (kv_cache.max_size
    # x the role's instances): the scheduler caps what a member record claims at it. Derived
    # from the rest of the config, so not compared.
    kv_budget: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def tls(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None

    @property
    def etcd_host(self) -> str:
        return self.etcd.rsplit(":", 1)[0]

    @property
    def etcd_port(self) -> int:
        return int(self.etcd.rsplit(":", 1)[1])


def parse_discovery(raw: Any, base_dir: Path, files_here: bool) -> DiscoveryConfig | None:
    """``discovery``; ``files_here`` False: its TLS files need not exist on this host."""
    if raw is None:
        return None
    d = mapping(raw, "discovery", _DISCOVERY_KEYS)
    if "etcd" not in d:
        raise UserError("discovery.etcd: missing; name etcd's client endpoint, e.g. "
                        "`discovery: {etcd: \"127.0.0.1:2379\"}`")
    etcd = parse_url(d["etcd"], "discovery.etcd", "127.0.0.1:2379")
    prefix = d.get("prefix", DiscoveryConfig.prefix)
    if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.rstrip("/") == "":
        raise UserError(f"discovery.prefix: {prefix!r} must be a key path starting with /, "
                        f"e.g. \"/triton-disagg/demo\"")
    ttl = d.get("ttl_seconds", DiscoveryConfig.ttl_seconds)
    if not isinstance(ttl, int) or isinstance(ttl, bool) or ttl < 2:
        raise UserError(f"discovery.ttl_seconds: {ttl!r} must be a whole number of seconds "
                        f">= 2 (etcd leases count whole seconds), e.g. 10")
    files = {key: pem_file(d[key], f"discovery.{key}", base_dir, files_here)
             for key in _DISCOVERY_FILES if key in d}
    if ("cert_file" in files) != ("key_file" in files):
        raise UserError("discovery.cert_file and discovery.key_file: give both (the client "
                        "certificate and its key) or neither")
    for key in ("username", "password_env"):
        if key in d and (not isinstance(d[key], str) or not d[key].strip()):
            raise UserError(f"discovery.{key}: {d[key]!r} must be a non-empty string")
    if ("username" in d) != ("password_env" in d):
        raise UserError("discovery.username and discovery.password_env: give both (etcd's user "
                        "and the environment variable holding its password) or neither")
    if files_here and "password_env" in d and d["password_env"] not in os.environ:
        raise UserError(f"discovery.password_env: the environment variable {d['password_env']} "
                        f"is not set; export it with etcd's password for {d['username']}")
    return DiscoveryConfig(etcd=etcd, prefix=prefix.rstrip("/"), ttl_seconds=ttl,
                           username=d.get("username"), password_env=d.get("password_env"),
                           **files)


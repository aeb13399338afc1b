"""The etcd client and the key layout.

Library: ``etcd3gw`` (OpenStack; released for Python 3.10-3.13). It speaks etcd's v3
API through the JSON gateway that every etcd >= 3.4 serves on its client port, with
plain ``requests``, synchronously. That fits how membership runs: one heartbeat thread
per server and one poll thread per scheduler, no event loop to host (``aetcd`` is
asyncio-only, so it would need a private loop in a thread), and no second gRPC/protobuf
stack beside tritonclient's. The stale ``etcd3`` 0.12 (no release since 2020; its
generated protobuf code predates protobuf 4) is ruled out.

etcd3gw's watch is not used: it reads the stream in a background executor and, when
etcd goes away, the stream just ends with nothing told to the caller, so a watcher
could not tell "no change" from "etcd gone". :class:`.membership.Membership` polls a
range request instead (see there).

TLS and auth (``discovery.ca_file`` / ``cert_file`` / ``key_file``, ``username`` /
``password_env``): etcd3gw takes the CA and client certificate itself; user/password auth
it lacks, so :class:`AuthClient` gets a token from ``/v3/auth/authenticate`` and sends it
in the ``Authorization`` header of every request, authenticating again once when etcd
says the token is no longer valid (etcd forgets its tokens when it restarts).

Key layout: ``{prefix}/{role}/{grpc_url}``, one key per server, its value a
:class:`.record.MemberRecord` in JSON. The gRPC url is the server's identity: a server
restarted at the same address overwrites its own key.
"""

from __future__ import annotations

import base64
import os

import requests
from etcd3gw import Etcd3Client
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception

from triton_disagg.config.discovery_section import DiscoveryConfig

# etcd did not answer (down, restarting, unreachable). Any other Etcd3Exception is etcd
# answering with an error (for example a lease it no longer knows).
UNREACHABLE = (ConnectionFailedError, ConnectionTimeoutError, requests.RequestException)
# Everything a call may raise because of etcd rather than because of a bug here.
ETCD_ERRORS = (Etcd3Exception, requests.RequestException)


def connect(discovery: DiscoveryConfig, timeout: float) -> Etcd3Client:
    """A client for ``discovery.etcd`` with its TLS and auth settings; every request gives
    up after ``timeout`` seconds. Nothing is sent until the first call (which then asks etcd
    for its API version).

    Its session ignores the environment (``trust_env`` off): with it on, requests lets
    ``REQUESTS_CA_BUNDLE`` / ``CURL_CA_BUNDLE`` override the session's CA (requests issue
    3829), so ``ca_file`` would be silently replaced, and ``HTTP_PROXY`` would route etcd
    traffic through a proxy. etcd is always reached directly."""
    session = requests.Session()
    session.trust_env = False
    if discovery.ca_file is not None:
        session.verify = discovery.ca_file
    if discovery.cert_file is not None:
        session.cert = (discovery.cert_file, discovery.key_file)
    where = {"host": discovery.etcd_host, "port": discovery.etcd_port, "timeout": timeout,
             "protocol": "https" if discovery.tls else "http", "session": session}
    if discovery.username is None:
        return Etcd3Client(**where)
    return AuthClient(username=discovery.username,
                      password=os.environ.get(discovery.password_env or "", ""), **where)


class AuthClient(Etcd3Client):
    """An etcd3gw client that authenticates as ``username`` (see the module docstring).

    Invariant: every request but the authentication itself carries the current token; a
    request refused as unauthenticated is sent once more with a fresh token, never twice."""

    def __init__(self, username: str, password: str, **kwargs):
        super().__init__(**kwargs)
        self._credentials = {"name": username, "password": password}

    def post(self, url: str, *args, json=None, **kwargs):
        if "Authorization" not in self.session.headers:
            self._authenticate()
        try:
            return super().post(url, *args, json=json, **kwargs)
        except Etcd3Exception as exc:
            if "auth token" not in str(exc.detail_text) and exc.args[:1] != ("Unauthorized",):
                raise
        self._authenticate()
        return super().post(url, *args, json=json, **kwargs)

    def _authenticate(self) -> None:
        self.session.headers.pop("Authorization", None)
        reply = super().post(self.get_url("/auth/authenticate"), json=self._credentials)
        self.session.headers["Authorization"] = reply["token"]


def member_key(prefix: str, role: str, grpc_url: str) -> str:
    return f"{prefix}/{role}/{grpc_url}"


def role_prefix(prefix: str, role: str) -> str:
    """The range every member key of ``role`` under ``prefix`` lies in (the trailing ``/``
    keeps ``/a`` from matching ``/ab/...``)."""
    return f"{prefix}/{role}/"


def read_prefix(client: Etcd3Client, key_prefix: str,
                limit: int) -> tuple[list[tuple[str, bytes]], int]:
    """The first ``limit`` keys under ``key_prefix`` (etcd's key order) with their values,
    and how many keys lie under it in all (etcd's ``count``, the ones read included).

    One range request through etcd's JSON gateway, sent with the client's :meth:`post`
    (so TLS and :class:`AuthClient`'s token apply): etcd3gw's ``get`` takes ``limit`` but
    drops ``count``. ``key_prefix`` ends in ``/``, so its range ends at the same text with
    that last byte + 1. A reply that cannot be read raises (KeyError, ValueError, ...)."""
    start = key_prefix.encode()
    end = start[:-1] + bytes([start[-1] + 1])
    reply = client.post(client.get_url("/kv/range"), json={
        "key": base64.b64encode(start).decode(), "range_end": base64.b64encode(end).decode(),
        "limit": limit})
    kvs = [(base64.b64decode(kv["key"]).decode(errors="replace"),
            base64.b64decode(kv.get("value", ""))) for kv in reply.get("kvs", ())]
    return kvs, int(reply.get("count", 0))          # the gateway leaves out a count of 0

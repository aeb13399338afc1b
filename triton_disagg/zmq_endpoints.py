"""Where a ZeroMQ socket of this project binds: ``ipc://`` in a private runtime directory
on one host, ``tcp://`` on a named host's address when peers may be remote.

Invariants: an ipc endpoint lives in a directory of its own (mode 0700, under
``$XDG_RUNTIME_DIR`` when usable, else the temp dir), named for its owner process like
the project's ``/dev/shm`` entries (:mod:`triton_disagg.shm`): :meth:`Endpoint.release`
removes it with the socket file, and each ipc bind removes the directories whose owner
is gone (a killed stub). A tcp endpoint binds a free port on the address ``host``
resolves to and advertises exactly that address, so a peer can connect to it as given;
or, given ``bind_host`` (a server's ``--host``, possibly a wildcard), binds there and
advertises ``host`` as written (``--advertise``: a name its peers resolve).

A tcp socket can be reached from other hosts, so the tcp channel is CurveZMQ: every
socket that binds is a CURVE server with one keypair derived from the deployment
secret (:mod:`triton_disagg.kv.secret`, the key that signs KV handles), and every
socket that connects names that server key with a fresh keypair of its own. A peer
without the secret cannot compute the server key, so it can neither connect nor read
the traffic; ipc needs none of it (its directory is the owner's alone).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.utils.z85

from triton_disagg import shm

KIND = "zmq"     # the owner-named kind of the ipc directories
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 1000, 5000    # a PUSH socket's peer liveness


@dataclass(frozen=True)
class Endpoint:
    address: str                       # what peers connect to
    directory: Path | None = None      # the private directory of an ipc endpoint

    def release(self) -> None:
        """Remove the ipc socket file and its directory (after the socket is closed)."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def bind(sock: zmq.Socket, host: str | None, name: str, bind_host: str | None = None,
         port: int | None = None) -> Endpoint:
    """Bind ``sock``: ipc (``host`` None) as ``<private dir>/<name>``, else tcp on ``host``
    (or on ``bind_host``, advertising ``host``), on ``port`` or else a free one."""
    if host is None:
        runtime = _runtime_dir()
        _sweep(runtime)
        directory = runtime / shm.new_name(KIND)
        directory.mkdir(mode=0o700)
        address = f"ipc://{directory / name}"
        try:
            sock.bind(address)
        except zmq.ZMQError:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return Endpoint(address, directory)
    public, secret = server_keys()
    sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
    where = bind_host if bind_host is not None else socket.gethostbyname(host)
    if port is None:
        port = sock.bind_to_random_port(f"tcp://{where}")
    else:
        sock.bind(f"tcp://{where}:{port}")
    return Endpoint(f"tcp://{host if bind_host is not None else where}:{port}")


def push_socket(context: zmq.Context, address: str, high_water_mark: int) -> zmq.Socket:
    """A PUSH socket connected to ``address`` that never blocks its owner: at most
    ``high_water_mark`` messages wait for a slow peer (then a NOBLOCK send raises
    ``zmq.Again``) and closing drops what is unsent. A peer that stops answering
    heartbeats for ``HEARTBEAT_TIMEOUT_MS`` (a host gone without closing) is disconnected,
    as one that closes is (a monitor sees both: ``zmq.EVENT_DISCONNECTED``)."""
    sock = context.socket(zmq.PUSH, socket_class=zmq.Socket)
    sock.setsockopt(zmq.SNDHWM, high_water_mark)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    connect(sock, address)
    return sock


def connect(sock: zmq.Socket, address: str) -> None:
    """Connect ``sock`` to a socket :func:`bind` bound: over tcp as a CURVE client (a fresh
    keypair of its own, naming the deployment's server key), over ipc as it is."""
    if address.startswith("tcp://"):
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = server_keys()[0]
    sock.connect(address)


@functools.lru_cache(maxsize=1)
def server_keys() -> tuple[bytes, bytes]:
    """``(public, secret)``: the Z85 CURVE keypair of every tcp socket that binds."""
    from triton_disagg.kv.secret import deployment_key

    seed = hmac.new(deployment_key(), b"triton-disagg token channel", hashlib.sha256).digest()
    secret = zmq.utils.z85.encode(seed)                 # 32 bytes -> 40 Z85 characters
    return zmq.curve_public(secret), secret


def _runtime_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    usable = runtime and os.access(runtime, os.W_OK | os.X_OK)
    return Path(runtime if usable else tempfile.gettempdir())


def _sweep(runtime: Path) -> None:
    """Remove this user's ipc directories in ``runtime`` whose owner process is gone."""
    for name in os.listdir(runtime):
        if name.startswith(f"{shm.PREFIX}{KIND}_") and shm.orphaned(name) \
                and shm.mine(str(runtime / name), directory=True):
            shutil.rmtree(runtime / name, ignore_errors=True)

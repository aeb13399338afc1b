"""Hosts on one machine: Linux network namespaces joined by a bridge, for the cluster tests
(tests/support/netns_hosts.py) and ``bench overlap --link-mbit``.

``with Hosts(["ctx", "gen", "sched"]) as hosts:`` makes one namespace per host, each
with ``lo`` up and an ``eth0`` at ``hosts.address(name)`` (``SUBNET``.1, .2, ... in the
order given, a /24), every ``eth0`` a veth whose peer is a port of bridge ``br0`` in a
namespace of its own. :meth:`Hosts.popen` / :meth:`Hosts.run` start a command on a host
(``ip netns exec``, which execs, so the Popen's pid is the command's); it runs in a new
session, so its process group is stopped by that pid. :meth:`Hosts.shape` limits what a
host sends to a rate (``tc`` token bucket on its ``eth0``), as a slower link would.

What a host's processes see: their own network stack, and UCX told to use TCP on
``eth0`` alone (``UCX_ENV``). The namespaces share this machine's filesystem, ``/dev/shm``
included, and UCX would take shared memory between them: as on separate machines, the
KV cache must cross the bridge.

Invariants: nothing is made in the root namespace (each veth is born in its host's
namespace with its peer in the bridge's), so deleting the namespaces removes every
link, and its shaping with it; traffic between hosts stays on the bridge, which has no
address and no route out. Namespace names are ``PREFIX<owner pid>-<host>``: leaving the
block (also by an exception), or the interpreter's exit, stops what still runs in them
and deletes them, and each start first removes those whose owner process is gone.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
from pathlib import Path

from triton_disagg.launch.process_group import terminate

PREFIX = "tdn"                 # this harness's namespaces, and nothing else's
SUBNET = "10.213.7"            # a private /24 that lives only inside the namespaces
BRIDGE = "br"                  # the bridge namespace's host name
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
STOP_SECONDS = 20.0
# Shaping (tc tbf): the bucket holds at least SHAPE_BURST_BYTES (a GSO segment of 64 KiB
# passes whole) and SHAPE_BURST_SECONDS at the rate; a packet that would wait more than
# SHAPE_QUEUE_MS for tokens is dropped (TCP backs off, as on a full switch port).
SHAPE_BURST_BYTES = 128 * 1024
SHAPE_BURST_SECONDS = 0.001
SHAPE_QUEUE_MS = 20


class HostsUnavailable(RuntimeError):
    """This machine cannot make namespaces (not root, or no ``ip``/``tc``)."""


def unavailable(tools: tuple[str, ...] = ("ip",)) -> str | None:
    """Why this machine cannot make hosts (with ``tools`` of iproute2), in one line; None
    when it can."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        return (f"network-namespace hosts need root and iproute2's {', '.join(tools)} (run as "
                f"root, e.g. in CI or a container with CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    return None


class Hosts:
    """The hosts ``names`` (see the module docstring); one instance at a time per process."""

    def __init__(self, names: list[str]):
        if unavailable():
            raise HostsUnavailable(unavailable())
        if len(set(names)) != len(names) or BRIDGE in names or not 0 < len(names) < 254:
            raise ValueError(f"host names must be distinct, not {BRIDGE!r}: {names}")
        self.names = list(names)
        self.processes: list[subprocess.Popen] = []
        self._made: list[str] = []

    def namespace(self, host: str) -> str:
        return f"{PREFIX}{os.getpid()}-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.names.index(host) + 1}"

    def __enter__(self) -> "Hosts":
        sweep()
        atexit.register(self.close)
        try:
            bridge = self._add(BRIDGE)
            _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", bridge, "link", "set", "br0", "up")
            for i, host in enumerate(self.names):
                ns, port = self._add(host), f"p{i}"
                _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                    "netns", bridge)
                _ip("-n", bridge, "link", "set", port, "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add(self, host: str) -> str:
        ns = self.namespace(host)
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def link(self, host: str, up: bool) -> None:
        """Plug ``host``'s ``eth0`` in (``up``) or pull it out: the host drops off the
        network with its processes still running."""
        _ip("-n", self.namespace(host), "link", "set", "eth0", "up" if up else "down")

    def shape(self, host: str, mbit: float) -> None:
        """Limit what ``host`` sends out of its ``eth0`` to ``mbit`` Mbit/s (a ``tc`` token
        bucket filter as its root qdisc); what it receives is not limited."""
        rate = mbit * 1e6 / 8                                   # bytes per second
        burst = max(SHAPE_BURST_BYTES, int(rate * SHAPE_BURST_SECONDS))
        _run("tc", "-n", self.namespace(host), "qdisc", "replace", "dev", "eth0", "root", "tbf",
             "rate", f"{int(mbit * 1000)}kbit", "burst", str(burst),
             "latency", f"{SHAPE_QUEUE_MS}ms")

    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` as run on ``host`` (with ``UCX_ENV``); ``ip`` and ``env`` exec it."""
        return ["ip", "netns", "exec", self.namespace(host), "env",
                *(f"{k}={v}" for k, v in UCX_ENV.items()), *argv]

    def popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on ``host`` in a new session; :meth:`close` stops it if it still runs."""
        proc = subprocess.Popen(self.command(host, argv), start_new_session=True, **kwargs)
        self.processes.append(proc)
        return proc

    def run(self, host: str, argv: list[str], timeout: float = 120.0,
            **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` to its end (text output captured); killed after ``timeout``."""
        proc = self.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            terminate(proc, 0, whole_group=True)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def tx_bytes(self, host: str) -> int:
        """Bytes ``host`` has sent out of its ``eth0`` so far."""
        return int(self.run(host, ["cat", "/sys/class/net/eth0/statistics/tx_bytes"]).stdout)

    def close(self) -> None:
        """Stop this harness's processes (SIGTERM, then SIGKILL after ``STOP_SECONDS``) and
        whatever else runs in its namespaces, then delete them (idempotent)."""
        for proc in self.processes:
            terminate(proc, STOP_SECONDS, whole_group=True)
        self.processes.clear()
        for ns in reversed(self._made):
            _delete(ns)
        self._made.clear()
        atexit.unregister(self.close)


def sweep() -> None:
    """Delete the namespaces of this prefix whose owner process is gone (and what runs there)."""
    netns = Path("/run/netns")
    for name in sorted(os.listdir(netns)) if netns.is_dir() else ():
        owner = name[len(PREFIX):].split("-", 1)[0]
        if name.startswith(PREFIX) and owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _delete(name)


def _delete(ns: str) -> None:
    """SIGKILL every process in ``ns`` (started there by this harness), then delete it."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in pids.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _ip(*args: str) -> None:
    _run("ip", *args)


def _run(*argv: str) -> None:
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")

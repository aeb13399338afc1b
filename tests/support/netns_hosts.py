"""Hosts on one machine for tests: Linux network namespaces joined by a bridge.

``with Hosts(["ctx", "gen", "sched"]) as hosts:`` makes one namespace per host, each
with ``lo`` up and an ``eth0`` at ``hosts.address(name)`` (``SUBNET``.1, .2, ... in the
order given, a /24), every ``eth0`` a veth whose peer is a port of bridge ``br0`` in a
namespace of its own. :meth:`Hosts.popen` / :meth:`Hosts.run` start a command on a host
(``ip netns exec``, which execs, so the Popen's pid is the command's); it runs in a new
session, so its process group is stopped by that pid. :meth:`Hosts.python` runs Python
there with the tests' helpers importable; :func:`grpc_streams` and :func:`scrape` use it
to reach servers from inside a host (the root namespace has no route to them).

What a host's processes see: their own network stack, and UCX told to use TCP on
``eth0`` alone (``UCX_ENV``). The namespaces share this machine's filesystem, ``/dev/shm``
included, and UCX would take shared memory between them: as on separate machines, the
KV cache must cross the bridge.

Invariants: nothing is made in the root namespace (each veth is born in its host's
namespace with its peer in the bridge's), so deleting the namespaces removes every
link; traffic between hosts stays on the bridge, which has no address and no route
out. Namespace names are ``PREFIX<owner pid>-<host>``: leaving the block (also by an
exception), or the interpreter's exit, stops what still runs in them and deletes them,
and each start first removes those whose owner process is gone.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from triton_disagg.launch.process_group import terminate

PREFIX = "tdn"                 # this harness's namespaces, and nothing else's
SUBNET = "10.213.7"            # a private /24 that lives only inside the namespaces
BRIDGE = "br"                  # the bridge namespace's host name
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
STOP_SECONDS = 20.0
# Where serve_role's servers listen. Each host has its own network namespace, so every host
# can use the same ports: the scheduler's gRPC on one, any other role's on another.
ROLE_GRPC_PORT, SCHEDULER_GRPC_PORT, METRICS_PORT = 9001, 8001, 9100
STREAMS = """
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import servers
url, max_tokens, go, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
print("ready", flush=True)
while go and not os.path.exists(go):
    time.sleep(0.01)
def stream(prompt):
    try:
        text, error = "".join(servers.grpc_stream(url, prompt, max_tokens)), None
    except Exception as exc:
        text, error = "", str(exc)
    return {"text": text, "error": error, "ended": time.monotonic()}
with ThreadPoolExecutor(len(prompts)) as pool:
    print(json.dumps(list(pool.map(stream, prompts))))
"""
SCRAPE = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())"


class HostsUnavailable(RuntimeError):
    """This machine cannot make namespaces (not root, or no ``ip``)."""


def unavailable() -> str | None:
    """Why this machine cannot make hosts, in one line; None when it can."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return ("network-namespace hosts need root and iproute2's `ip` (run the tests as "
                "root, e.g. in CI or a container with CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    return None


def hosts_fixture(names: tuple[str, ...] | list[str]):
    """A pytest fixture giving a test :class:`Hosts` of ``names`` (``hosts =
    hosts_fixture(HOSTS)`` in a test module); a machine that cannot make them fails the
    test in one line (never a skip: CI runs as root)."""
    import pytest

    @pytest.fixture
    def hosts():
        if unavailable():
            pytest.fail(unavailable(), pytrace=False)
        with Hosts(list(names)) as made:
            yield made
    return hosts


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

    def python(self, host: str, code: str, *args: str, timeout: float = 120.0) -> str:
        """Run Python ``code`` on ``host`` with the tests' helpers importable; its stdout
        (an AssertionError with its stderr when it fails)."""
        out = self.run(host, [sys.executable, "-c", code, *args], timeout=timeout, env=_tests_env())
        assert out.returncode == 0, out.stderr
        return out.stdout

    def link(self, host: str, up: bool) -> None:
        """Plug ``host``'s ``eth0`` in (``up``) or pull it out: the host drops off the
        network with its processes still running."""
        _ip("-n", self.namespace(host), "link", "set", "eth0", "up" if up else "down")

    def throttle(self, host: str, rate: str) -> None:
        """Cap what ``host`` sends out of its ``eth0`` at ``rate`` (tc's words: ``20mbit``),
        a token bucket on the link: a slow network, for transfers that take seconds."""
        out = subprocess.run(["ip", "netns", "exec", self.namespace(host), "tc", "qdisc",
                              "replace", "dev", "eth0", "root", "tbf", "rate", rate,
                              "burst", "32kbit", "latency", "400ms"],
                             capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"tc on {host}: {out.stderr.strip()}")

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


def _tests_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}


def grpc_streams(hosts: Hosts, host: str, url: str, max_tokens: int,
                 prompts: list[str]) -> list[str]:
    """Stream every prompt at once from ``host`` to the ensemble at ``url`` (gRPC); the texts,
    every one complete."""
    out = hosts.python(host, STREAMS, url, str(max_tokens), "", *prompts)
    outcomes = json.loads(out.splitlines()[-1])
    assert not any(o["error"] for o in outcomes), [o["error"] for o in outcomes]
    return [o["text"] for o in outcomes]


class HeldStreams:
    """:func:`grpc_streams` with the client started (its imports done) and its streams held
    until :meth:`texts`, so they start at a moment the test picks, however loaded the machine."""

    def __init__(self, hosts: Hosts, host: str, url: str, max_tokens: int, prompts: list[str],
                 go: Path):
        self.go = go
        self.proc = hosts.popen(host, [sys.executable, "-c", STREAMS, url, str(max_tokens),
                                       str(go), *prompts],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_tests_env())
        assert self.proc.stdout.readline() == "ready\n", self.proc.communicate()[1]

    def texts(self, timeout: float = 120.0) -> list[str]:
        """Start the streams (if :meth:`start` did not); their texts, every one complete."""
        outcomes = self.outcomes(timeout)
        assert not any(o["error"] for o in outcomes), [o["error"] for o in outcomes]
        return [o["text"] for o in outcomes]

    def start(self) -> None:
        self.go.touch()

    def outcomes(self, timeout: float = 120.0) -> list[dict]:
        """Start the streams (if :meth:`start` did not); per stream ``text`` (what came),
        ``error`` (the client's exception as it reads, None if none) and ``ended``
        (CLOCK_MONOTONIC, one clock for every namespace)."""
        self.start()
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, err
        return json.loads(out.splitlines()[-1])


def serve_role(hosts: Hosts, host: str, role: str, config: Path, work_dir: Path) -> tuple:
    """``serve ROLE`` on ``host`` (the command line of :func:`serve_argv`, as a pod runs it)
    on this module's ports, as :func:`servers.serve_commands` takes it."""
    from servers import cli_argv
    from triton_disagg.launch.serve_argv import serve_argv

    grpc_port = SCHEDULER_GRPC_PORT if role == "scheduler" else ROLE_GRPC_PORT
    argv = serve_argv(role, str(config), hosts.address(host), grpc_port, METRICS_PORT)
    cmd = [*cli_argv(argv), "--work-dir", str(work_dir)]
    return hosts.command(host, cmd), work_dir, None, f"{hosts.address(host)}:{grpc_port}", None


def metrics_of(hosts: Hosts, host: str) -> dict:
    """``host``'s server's metrics (:func:`serve_role`'s port), parsed, read from the
    scheduler's host."""
    from triton_disagg.routing.scrape import parse_metrics

    url = f"http://{hosts.address(host)}:{METRICS_PORT}/metrics"
    return parse_metrics(scrape(hosts, "scheduler", url))


def scrape(hosts: Hosts, host: str, metrics_url: str) -> str:
    """The metrics text at ``metrics_url`` (http://host:port/metrics), read from ``host``."""
    return hosts.python(host, SCRAPE, metrics_url)


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
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")

"""Hosts on one machine for tests: the network-namespace hosts of
:mod:`triton_disagg.launch.netns` (namespaces, bridge, addresses, process control, shaping;
read its docstring), plus what tests do on them. :meth:`Hosts.python` runs Python on a
host with the tests' helpers importable; :func:`grpc_streams` and :func:`scrape` use it
to reach servers from inside a host (the root namespace has no route to them);
:func:`serve_role` writes a role's ``serve`` command for a host; :func:`named_hosts` lets
every host reach the others by their names, as a deployment's DNS would.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from triton_disagg.launch import netns

# Where serve_role's servers listen. Each host has its own network namespace, so every host
# can use the same ports: the scheduler's gRPC on one, any other role's on another.
ROLE_GRPC_PORT, SCHEDULER_GRPC_PORT, METRICS_PORT = 9001, 8001, 9100
STREAMS = """
import json, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import servers
url, max_tokens, go, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
print("ready", flush=True)
while go and not os.path.exists(go):
    time.sleep(0.01)
flowing, lock = set(), threading.Lock()
def arrived(prompt_index, pieces):
    if pieces == 2:                       # the second piece: decoding, past the context's first
        with lock:
            flowing.add(prompt_index)
            if len(flowing) == len(prompts):
                open(go + ".flowing", "w").close()
def stream(indexed):
    index, prompt = indexed
    try:
        text = "".join(servers.grpc_stream(url, prompt, max_tokens,
                                           arrived=lambda n: arrived(index, n)))
        error = None
    except Exception as exc:
        text, error = "", str(exc)
    return {"text": text, "error": error, "ended": time.monotonic()}
with ThreadPoolExecutor(len(prompts)) as pool:
    print(json.dumps(list(pool.map(stream, enumerate(prompts)))))
"""
# `ip netns exec NS` bind-mounts every file in /etc/netns/NS/ over its namesake in /etc/
ETC_NETNS = Path("/etc/netns")
SCRAPE = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())"


def hosts_fixture(names: tuple[str, ...] | list[str]):
    """A pytest fixture giving a test :class:`Hosts` of ``names`` (``hosts =
    hosts_fixture(HOSTS)`` in a test module); a machine that cannot make them fails the
    test in one line (never a skip: CI runs as root)."""
    import pytest

    @pytest.fixture
    def hosts():
        if netns.unavailable():
            pytest.fail(netns.unavailable(), pytrace=False)
        with Hosts(list(names)) as made:
            yield made
    return hosts


class Hosts(netns.Hosts):
    """:class:`triton_disagg.launch.netns.Hosts` with Python to run on a host."""

    def python(self, host: str, code: str, *args: str, timeout: float = 120.0) -> str:
        """Run Python ``code`` on ``host`` with the tests' helpers importable; its stdout
        (an AssertionError with its stderr when it fails)."""
        out = self.run(host, [sys.executable, "-c", code, *args], timeout=timeout, env=_tests_env())
        assert out.returncode == 0, out.stderr
        return out.stdout


@contextlib.contextmanager
def named_hosts(hosts: Hosts):
    """Within the block, a command run on any of ``hosts`` resolves every host's name to its
    address (an ``/etc/hosts`` of this machine's plus one line per host, which ``ip netns
    exec`` mounts over ``/etc/hosts`` from ``/etc/netns/<namespace>/hosts``); removed after,
    with those a dead test run left (namespaces of an owner process gone)."""
    lines = "".join(f"{hosts.address(name)} {name}\n" for name in hosts.names)
    table = Path("/etc/hosts").read_text() + "\n" + lines
    _sweep_names()
    made = [ETC_NETNS / hosts.namespace(name) for name in hosts.names]
    try:
        for folder in made:
            folder.mkdir(parents=True)
            (folder / "hosts").write_text(table)
        yield
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


def _sweep_names() -> None:
    for folder in ETC_NETNS.glob(f"{netns.PREFIX}*-*") if ETC_NETNS.is_dir() else ():
        owner = folder.name[len(netns.PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(folder, ignore_errors=True)


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

    def wait_flowing(self, timeout: float = 60.0) -> None:
        """Until every stream has its second piece (decoding under way); fails the test
        if a stream ends or ``timeout`` passes first."""
        from waiting import wait_until

        flowing = Path(f"{self.go}.flowing")
        wait_until(lambda: flowing.exists() or self.proc.poll() is not None, timeout,
                   "every stream flowing", poll=0.005)
        assert flowing.exists(), ("streams ended before all flowed", self.proc.communicate())

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

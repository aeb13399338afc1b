"""A real etcd for tests (import as ``import etcd_server``): Debian's ``etcd-server``
binary on free loopback ports with its own data dir, started and stopped by PID.

:meth:`EtcdServer.kill` (SIGKILL) then :meth:`EtcdServer.start` brings etcd back on the
same data dir and ports, as a crashed etcd restarted by its supervisor. A missing
``etcd`` binary fails the test with one line naming the fix; it is never a skip.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from triton_disagg.config.discovery_section import DiscoveryConfig
from triton_disagg.launch.deploy import free_ports

START_TIMEOUT = 15.0


def etcd_binary() -> str:
    found = shutil.which("etcd")
    if found is None:
        pytest.fail("etcd not found on PATH: apt-get install etcd-server (as root, `make test` "
                    "installs it)", pytrace=False)
    return found


class EtcdServer:
    def __init__(self, data_dir: Path):
        etcd_binary()                   # fail at once, in one line, when it is missing
        self.data_dir = data_dir
        self.client_port, self.peer_port = free_ports(2)
        self.log = data_dir.parent / f"{data_dir.name}.log"
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def discovery(self, prefix: str, ttl_seconds: int) -> DiscoveryConfig:
        return DiscoveryConfig(etcd=self.endpoint, prefix=prefix, ttl_seconds=ttl_seconds)

    def start(self) -> "EtcdServer":
        """Start etcd on this data dir and these ports; return once it answers."""
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                command(self.data_dir, "127.0.0.1", self.client_port, self.peer_port),
                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"etcd did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        return self

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        self._end(signal.SIGTERM)

    def _end(self, sig: int) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def command(data_dir: Path, host: str, client_port: int, peer_port: int) -> list[str]:
    """A one-member etcd serving clients at ``host:client_port`` (peers on loopback)."""
    client, peer = f"http://{host}:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [etcd_binary(), "--name", "test", "--data-dir", str(data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"test={peer}"]


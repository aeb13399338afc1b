"""A real Prometheus for tests (import as ``import prometheus_server``): Debian's
``prometheus`` binary scraping a test server with the project's own scrape config,
its web API on a free loopback port, its storage in a temp dir, stopped by PID.

The config is ``docs/observability/prometheus.yml`` as shipped, with two changes: the
scrape interval is :data:`SCRAPE_INTERVAL` and the one target is the test server's
metrics port (its ``deployment`` label and every other setting stay). A missing
``prometheus`` binary fails the test with one line naming the fix; it is never a skip.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from triton_disagg.launch.deploy import free_ports

SHIPPED_CONFIG = Path(__file__).resolve().parents[2] / "docs" / "observability" / "prometheus.yml"
SCRAPE_INTERVAL = "1s"
START_TIMEOUT = 30.0


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.fail("prometheus not found on PATH: apt-get install prometheus (as root, `make "
                    "test` installs it)", pytrace=False)
    return found


def scrape_config(metrics_url: str, labels: dict[str, str] | None = None) -> dict:
    """The shipped config, scraping ``metrics_url`` (http://host:port) every
    :data:`SCRAPE_INTERVAL`; ``labels`` are added to the target's (as Kubernetes service
    discovery adds ``namespace`` and ``pod``)."""
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    config["global"]["scrape_interval"] = SCRAPE_INTERVAL
    (job,) = config["scrape_configs"]
    (static,) = job["static_configs"]
    static["targets"] = [urllib.parse.urlsplit(metrics_url).netloc]
    static["labels"] = {**static.get("labels", {}), **(labels or {})}
    return config


class PrometheusServer:
    """Prometheus scraping ``metrics_url``; its files (config, storage, log) go in ``work_dir``."""

    def __init__(self, metrics_url: str, work_dir: Path, labels: dict[str, str] | None = None):
        self.binary = prometheus_binary()      # fail at once, in one line, when it is missing
        work_dir.mkdir(parents=True, exist_ok=True)
        self.config = work_dir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(scrape_config(metrics_url, labels)))
        self.storage, self.log = work_dir / "data", work_dir / "prometheus.log"
        (self.port,) = free_ports(1)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "PrometheusServer":
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [self.binary, f"--config.file={self.config}",
                 f"--storage.tsdb.path={self.storage}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"prometheus did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict]:
        """The instant vector of ``expr`` now: ``[{"metric": {labels}, "value": [t, "v"]}]``."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        assert body["data"]["resultType"] == "vector", (expr, body["data"]["resultType"])
        return body["data"]["result"]

    def targets_up(self) -> bool:
        """Every scrape target's last scrape succeeded."""
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as resp:
            active = json.loads(resp.read())["data"]["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def stop(self) -> None:
        """SIGTERM by PID (SIGKILL after 10 s)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

"""`bench overlap --link-mbit N`: the two deployments (without and with
``--overlap_kv_transfer``) across two hosts joined by a link of N Mbit/s.

Hosts are network namespaces (:mod:`triton_disagg.launch.netns`): ``context`` runs both
deployments' ``serve context``; ``generation`` runs both ``serve generation`` and both
``serve scheduler`` (the client's side), each deployment on its own ports, started with the
guide's commands (:func:`~triton_disagg.launch.serve_argv.serve_argv`, one config per
deployment whose urls name the two hosts). What the context host sends is shaped to N
Mbit/s (:meth:`~triton_disagg.launch.netns.Hosts.shape`): generation's NIXL READs ask
little and the KV comes back from the context, so that direction carries the bytes.
The client is a :class:`~triton_disagg.bench.second_token.Worker` on the generation host.

Invariants: both deployments share the cores (context and front end on the first half of
``--cpus``, generation on the rest, as in the one-host mode) and the link; every process
started here runs in the namespaces and is stopped, and the namespaces deleted, when the
block exits, also by an exception.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator, Sequence

from triton_disagg.config.roles import ENGINE_ROLES, PLACED_ROLES, Role

HOSTS = ("context", "generation")
HOST_OF = {"context": "context", "generation": "generation", "scheduler": "generation"}
GRPC_PORT = {"context": 9001, "generation": 9002, "scheduler": 8001}
# Each role's other ports sit at fixed distances from its gRPC port; the "with" deployment's
# at MODE_OFFSET from the "without" one's, so the two share the hosts without a clash.
METRICS_OFFSET, FRONT_OFFSET, HTTP_OFFSET, MODE_OFFSET = 100, 200, 300, 1000


def refusal() -> str | None:
    """Why this machine cannot run the link mode, in one line; None when it can."""
    from triton_disagg.launch.netns import unavailable

    why = unavailable(("ip", "tc"))
    return f"bench overlap --link-mbit: {why}" if why else None


def config_text(engine: Path, hosts, offset: int, placed: dict, kv_max_size: str,
                stall_seconds: float, runtime: str) -> str:
    """One deployment's disagg_config.yaml: the roles' urls on the hosts' addresses;
    ``stall_seconds``: every call's deadline between roles; ``runtime``: model.runtime."""
    url: dict[str, str] = {role: f"{hosts.address(HOST_OF[role])}:{GRPC_PORT[role] + offset}"
           for role in ENGINE_ROLES}
    return (f"model: {{engine: \"{engine}\", runtime: {runtime}, device: cpu}}\n"
            f"context_server: {{url: \"{url['context']}\", "
            f"cpus: {placed['context_server']['cpus']}}}\n"
            f"generation_server: {{url: \"{url['generation']}\", "
            f"cpus: {placed['generation_server']['cpus']}, stall_seconds: {stall_seconds:g}}}\n"
            f"scheduler_server: {{cpus: {placed['scheduler_server']['cpus']}}}\n"
            f"kv_cache: {{strategy: direct_transfer, max_size: {kv_max_size}}}\n")


def serve_command(hosts, role: str, config: Path, offset: int, overlap: bool,
                  work_dir: Path) -> list[str]:
    """``triton-disagg serve ROLE`` (by this interpreter) on its host and the mode's ports."""
    from triton_disagg.launch.serve_argv import serve_argv

    grpc = GRPC_PORT[role] + offset
    argv = serve_argv(role, str(config), hosts.address(HOST_OF[role]), grpc,
                      grpc + METRICS_OFFSET, front_port=grpc + FRONT_OFFSET,
                      http_port=grpc + HTTP_OFFSET if role == Role.SCHEDULER else None)
    return [sys.executable, "-m", "triton_disagg.cli", *argv[1:], "--work-dir", str(work_dir),
            *(["--overlap_kv_transfer"] if overlap else [])]


@contextlib.contextmanager
def linked(engine: Path, cores: Sequence[int], work_dir: Path, modes: Sequence[str], say,
           kv_max_size: str, stall_seconds: float, runtime: str
           ) -> Iterator[tuple[dict[str, str], Callable, "Link"]]:
    """The deployments of ``modes`` ("without", "with") on the two hosts (the rest as
    :func:`config_text` takes it); yields
    ``({mode: scheduler gRPC url}, client, link)``: the client a
    :class:`~triton_disagg.bench.second_token.Worker` on the generation host."""
    from triton_disagg.launch.netns import Hosts
    from triton_disagg.bench.second_token import Worker
    from triton_disagg.bench.serve_servers import wait_ready
    from triton_disagg.bench.serve_servers import placement
    from triton_disagg.kv.secret import SECRET_ENV

    placed = placement("disaggregated", cores)
    env = {**os.environ, SECRET_ENV: secrets.token_hex(32)}     # hosts apart share it
    with Hosts(list(HOSTS)) as hosts:
        say(f"hosts {', '.join(f'{h} {hosts.address(h)}' for h in HOSTS)}")
        started, urls = [], {}
        for i, kv_overlap in enumerate(modes):
            offset, folder = i * MODE_OFFSET, work_dir / f"{kv_overlap}-overlap"
            folder.mkdir(parents=True, exist_ok=True)
            config = folder / "disagg_config.yaml"
            config.write_text(config_text(engine, hosts, offset, placed, kv_max_size,
                                          stall_seconds, runtime))
            for role in PLACED_ROLES:
                log = folder / f"{role}.log"
                cmd = serve_command(hosts, role, config, offset, kv_overlap == "with",
                                    folder / role)
                with open(log, "wb") as out:
                    started.append((hosts.popen(HOST_OF[role], cmd, stdout=out,
                                                stderr=subprocess.STDOUT, env=env), log,
                                    f"bench overlap: `serve {role}` ({kv_overlap} overlap)"))
            urls[kv_overlap] = f"{hosts.address('generation')}:{GRPC_PORT['scheduler'] + offset}"
        for proc, log, what in started:
            wait_ready(proc, log, what)
        say(f"{len(started)} servers ready")
        worker = hosts.popen("generation", [sys.executable, "-m",
                                            "triton_disagg.bench.second_token"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        yield urls, Worker(worker), Link(hosts)


class Link:
    """The link between the two hosts of :func:`linked`."""

    def __init__(self, hosts):
        self.hosts = hosts

    def shape(self, mbit: float) -> None:
        """Limit what the context host sends to ``mbit`` Mbit/s (the KV's direction)."""
        self.hosts.shape("context", mbit)

    def sent(self) -> dict[str, int]:
        """Bytes each host has sent so far."""
        return {host: self.hosts.tx_bytes(host) for host in HOSTS}


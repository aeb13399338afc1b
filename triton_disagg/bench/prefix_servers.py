"""The deployment ``bench prefix`` measures: the guide's commands on this host, on free
loopback ports - two ``serve context`` servers, one ``serve generation``, and ``serve
scheduler`` routing over them - each from its own config file, so that the context servers'
cache and pool, the generation server's pool and the scheduler's router are set apart.
Every server's ``kv_cache.prefix_caching`` is the mode's (generation keeps a cache of its
own: a conversation's next turn fetches only the blocks it lacks, or, where the mode sets
``generation_server.max_local_prefill_length``, is prefilled there when at most that many
of its tokens are not cached).

Invariant: :meth:`Deployment.mode` yields every server started cold (nothing cached: a
mode never finds what an earlier mode left) and a scheduler that is ready (the roles it
routes to answer), and stops them all on exit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import yaml

from triton_disagg.bench.serve_servers import serve_cli
from triton_disagg.config.roles import Role
from triton_disagg.launch.deploy import free_port_run, free_ports

CONTEXT_SERVERS = 2
GENERATION_KV_BYTES = 512 * 2**20      # generation never limits the runs (nor evicts)


@dataclass(frozen=True)
class RoutingSetup:
    """One setup the prefix bench compares: the context router and its prefix caching."""

    name: str
    router: str               # the scheduler's context_server.router
    prefix_caching: bool      # the context servers' kv_cache.prefix_caching
    # generation prefills a prompt itself when few of its tokens are not in its cache (the
    # bench's --local-prefill); False: never (max_local_prefill_length 0, the default)
    local_prefill: bool = False


@dataclass(frozen=True)
class Running:
    front: str                        # http://127.0.0.1:PORT: the scheduler's OpenAI front
    model: str                        # the model id it serves (the engine directory's name)
    context_metrics: tuple[str, ...]  # http://127.0.0.1:PORT per context server
    generation_metrics: str           # http://127.0.0.1:PORT of the generation server

    @property
    def metrics(self) -> tuple[str, ...]:
        """Every server that may prefill a prompt: the context servers and generation."""
        return (*self.context_metrics, self.generation_metrics)


class Deployment:
    def __init__(self, engine: Path, work_dir: Path, say):
        self.engine, self.work_dir, self.say = engine, work_dir.resolve(), say
        *self.context_ports, self.generation_port = free_ports(CONTEXT_SERVERS + 1)
        self.urls = [f"127.0.0.1:{p}" for p in self.context_ports]
        self.kv_events_port = free_port_run(CONTEXT_SERVERS)   # one publisher per server

    def _config(self, name: str, kv_bytes: int, prefix_caching: bool, max_local_prefill: int,
                router: str = "round_robin") -> Path:
        path = self.work_dir / f"{name}.yaml"
        path.write_text(yaml.safe_dump({
            "model": {"engine": str(self.engine)},
            "context_server": {"urls": self.urls, "router": router,
                               "kv_events_port": self.kv_events_port},
            "generation_server": {"url": f"127.0.0.1:{self.generation_port}",
                                  "max_local_prefill_length": max_local_prefill},
            "kv_cache": {"strategy": "direct_transfer", "max_size": kv_bytes,
                         "prefix_caching": prefix_caching}}, sort_keys=False))
        return path

    def _ports(self, n: int) -> list[int]:
        """``n`` free ports none of which the deployment keeps for a server it has not
        started yet (the servers' gRPC ports and the KV events run are fixed across modes,
        and each is free until its server binds it)."""
        kept = {*self.context_ports, self.generation_port,
                *range(self.kv_events_port, self.kv_events_port + CONTEXT_SERVERS)}
        while True:
            ports = free_ports(n)
            if not kept & set(ports):
                return ports

    def _serve(self, role: str, config: Path, grpc: int, name: str, marker: str = "ready ("):
        front, metrics = self._ports(2)
        args = [role, "-c", str(config), "--host", "127.0.0.1", "--grpc-port", str(grpc),
                "--front-port", str(front), "--metrics-port", str(metrics),
                "--work-dir", str(self.work_dir / name)]
        if role == Role.SCHEDULER:
            args += ["--http-port", str(self._ports(1)[0])]
        return serve_cli(args, self.work_dir / f"{name}.log", marker=marker), front, metrics

    @contextlib.contextmanager
    def mode(self, mode: RoutingSetup, context_kv_bytes: int,
             max_local_prefill: int) -> Iterator[Running]:
        """A cold generation server (prefilling a prompt itself when at most
        ``max_local_prefill`` of its tokens are not cached; 0: never) and cold context servers
        with ``mode``'s cache (``context_kv_bytes`` each), and a scheduler with its router,
        until the block exits."""
        self.say(f"starting the generation server (local prefill {max_local_prefill}) and "
                 f"{CONTEXT_SERVERS} context servers (prefix_caching {mode.prefix_caching}, "
                 f"{context_kv_bytes / 2**20:.0f} MiB of KV each) and the scheduler "
                 f"({mode.router})")
        caching = mode.prefix_caching
        generation = self._config("generation", GENERATION_KV_BYTES, caching, max_local_prefill)
        context = self._config("context", context_kv_bytes, caching, max_local_prefill)
        scheduler = self._config("scheduler", context_kv_bytes, caching, max_local_prefill,
                                 mode.router)
        with contextlib.ExitStack() as stack:
            served, _, generation_metrics = self._serve("generation", generation,
                                                        self.generation_port, "generation")
            stack.enter_context(served)
            metrics = []
            for i, port in enumerate(self.context_ports):
                served, _, metrics_port = self._serve("context", context, port, f"context-{i}")
                stack.enter_context(served)
                metrics.append(f"http://127.0.0.1:{metrics_port}")
            served, front, _ = self._serve("scheduler", scheduler, self._ports(1)[0], "scheduler")
            stack.enter_context(served)
            yield Running(f"http://127.0.0.1:{front}", self.engine.name, tuple(metrics),
                          f"http://127.0.0.1:{generation_metrics}")


def deployment(engine: Path, work_dir: Path, say) -> Deployment:
    """Where and how the servers of each mode start (:meth:`Deployment.mode`)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    return Deployment(engine, work_dir, say)

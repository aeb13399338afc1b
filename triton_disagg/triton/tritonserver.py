"""Locate, start, health-check and stop a real ``tritonserver``.

Where the server comes from, first match wins: ``--tritonserver PATH``, the
``TRITON_DISAGG_TRITONSERVER`` environment variable (the GPU image sets it to
NGC's ``/opt/tritonserver/bin/tritonserver``), then the server embedded in the
``nvidia-pytriton`` wheel (Triton 2.51, CPU capable).

Embedded server facts this module relies on:

- binary ``pytriton/tritonserver/bin/tritonserver``; its shared libraries are
  in ``nvidia_pytriton.libs`` next to the ``pytriton`` package, which must be
  on ``LD_LIBRARY_PATH``;
- ``pytriton/tritonserver/backends/python`` has ``libtriton_python.so`` but no
  stub: the stub for the running Python is
  ``python_backend_stubs/<major.minor>/triton_python_backend_stub`` and is copied
  into a private backends folder;
- the stub embeds ``libpython<ver>.so``; it runs with this interpreter's
  packages when this interpreter's ``bin`` folder leads ``PATH`` and its
  ``LIBDIR`` leads ``LD_LIBRARY_PATH``.

Invariant: the server runs in its own process group (its Python stubs
included), so :meth:`TritonServer.stop` ends all of it and nothing else; it is
also SIGTERMed if the process that started it dies. Given cores, the server runs on
them from its first instruction, and so do the stubs it forks until a stub re-pins
itself (:mod:`triton_disagg.triton.placement`). Its Python-backend regions live in a
``/dev/shm`` of its own (:mod:`.private_shm`), where the host allows one: no other local
user sees them, and they go with the server. Else they are in the host's ``/dev/shm``
under a name owned by the process that started it (:mod:`triton_disagg.shm`): ``stop``
unlinks them once the server is gone, and every start and stop sweeps what killed
servers and stubs left behind.

Nothing on the server's command line (which every local user reads in ``ps``) grants
anything. Model control is off (``none``): Triton refuses load and unload over its API,
so no client can load a model (a model is code). The APIs no client needs, ``RESTRICTED_APIS``
(shared memory, logging, trace), answer only requests that carry the header
``RESTRICTED_HEADER``, a name no client can send: an HTTP header name ends at its first
``:`` and gRPC refuses a metadata key holding one, so they answer no one ("This API is
restricted"; health, metadata, inference and statistics stay open). A value of a sendable
header would be on the command line, and with it a local user could register Triton's
own Python-backend regions (their names are on the stubs' command lines) as shared memory
and read or write every request's tensors through inference
(``tests/server/test_local_users.py``). The gRPC endpoint accepts the orchestrators' keepalive pings
(:mod:`triton_disagg.front.grpc_transport`): every ``KEEPALIVE_MS``, idle calls included.
Triton 2.51 bounds no request's size (up to 2 GiB over gRPC): where its ports are public
(:class:`Endpoints` with inner ports: ``serve all|scheduler``) it listens on loopback on
those, in clear, behind the door (:mod:`triton_disagg.front.public_door`), which bounds
every message. By default Triton keeps up to 8 request objects for reuse, each holding
the capacity of the largest message it carried, so a run of large requests would ratchet
its memory up: it keeps none (``--grpc-infer-allocation-pool-size=0``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

from triton_disagg import shm
from triton_disagg.config.tls_section import GrpcTLS
from triton_disagg.errors import RetryableStart, UserError

from triton_disagg import log_format
from triton_disagg.triton import private_shm, server_log
from triton_disagg.triton.grpc_channel import client_options
from triton_disagg.triton.stub_start import STACKS_SIGNAL
from triton_disagg.triton.stub_watch import Stub
from triton_disagg.triton.endpoints import Endpoints, reachable
from triton_disagg.triton.stuck_start import StartWatch

STOP_GRACE_SECONDS = 15.0   # SIGTERM to SIGKILL when a server stops
STACKS_WAIT_SECONDS = 1.0   # for a stuck stub to write its stacks (stub_start.STACKS_SIGNAL)

ENV_OVERRIDE = "TRITON_DISAGG_TRITONSERVER"
RESTRICTED_APIS = ("shared-memory", "logging", "trace")
RESTRICTED_HEADER = "triton-disagg:closed"   # unsendable (module docstring)
KEEPALIVE_MS = 10_000       # the orchestrators' gRPC keepalive interval (servers allow half)


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backends: Path              # folder holding python/libtriton_python.so
    libs: Path | None           # extra LD_LIBRARY_PATH entry (the wheel's bundled libs)
    stub: Path | None           # stub to copy into backends/python, when not there already

    @property
    def stub_binary(self) -> Path:
        """The Python-backend stub the server will run (the wheel's original, whose RPATH
        still points at its bundled libraries, or the one in the server's backends)."""
        return self.stub or self.backends / "python" / "triton_python_backend_stub"


def locate(override: str | os.PathLike | None = None) -> TritonInstall:
    """Find a tritonserver (see the module docstring for the order)."""
    explicit = override or os.environ.get(ENV_OVERRIDE)
    if explicit:
        binary = Path(explicit)
        if binary.is_dir():
            binary = binary / "bin" / "tritonserver"
        if not binary.is_file():
            raise UserError(f"--tritonserver: {explicit} is not a tritonserver binary; pass the "
                            f"path to bin/tritonserver (e.g. /opt/tritonserver/bin/tritonserver)")
        return TritonInstall(binary, binary.parent.parent / "backends", None, None)
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("no tritonserver found: install nvidia-pytriton (`pip install "
                        "nvidia-pytriton`) or pass --tritonserver /opt/tritonserver/bin/tritonserver")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise UserError(f"nvidia-pytriton has no Python backend stub for Python {version}; run with "
                        f"a Python it ships ({', '.join(sorted(p.name for p in stub.parent.parent.iterdir()))})")
    return TritonInstall(root / "bin" / "tritonserver", root / "backends",
                         root.parent.parent / "nvidia_pytriton.libs", stub)


def prepare_backends(install: TritonInstall, work_dir: Path) -> Path:
    """The backends folder to pass to the server; the wheel's gets a private copy with the stub."""
    if install.stub is None:
        return install.backends
    dest = work_dir / "backends"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(install.backends / "python", dest / "python",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(install.stub, dest / "python" / "triton_python_backend_stub")
    return dest


def server_env(install: TritonInstall, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the server and its stubs: this interpreter's packages and libpython."""
    env = dict(os.environ)
    lib_dirs = [sysconfig.get_config_var("LIBDIR") or ""]
    if install.libs is not None:
        lib_dirs.append(str(install.libs))
    lib_dirs.append(env.get("LD_LIBRARY_PATH", ""))
    env["LD_LIBRARY_PATH"] = ":".join(d for d in lib_dirs if d)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra or {})
    return env


class TritonServer:
    """One tritonserver process group serving ``repo`` at ``endpoints``."""

    def __init__(self, install: TritonInstall, repo: Path, endpoints: Endpoints, work_dir: Path,
                 env: dict[str, str] | None = None, log_verbose: int = 0,
                 cpus: Sequence[int] = (), grpc_tls: GrpcTLS | None = None):
        """``cpus``: the cores the server process (and what it forks) runs on; () leaves it
        on this process's. ``grpc_tls``: serve gRPC over TLS (the config's ``grpc_tls``)."""
        self.install, self.repo, self.endpoints, self.work_dir = install, repo, endpoints, work_dir
        self.cpus = tuple(cpus)
        self.grpc_tls = None if endpoints.behind_door else grpc_tls     # the door's TLS then
        self.log_path = work_dir / "tritonserver.log"
        self.env = server_env(install, env)
        self.private_shm = private_shm.possible()
        self.host_shm = work_dir / "host-shm"   # the host's /dev/shm, seen from inside
        if self.private_shm:
            self.env[shm.DIR_ENV] = str(self.host_shm)
        self.log_verbose = log_verbose
        self.process: subprocess.Popen | None = None
        self.shm_prefix = shm.new_name("tpb") + "_"  # Triton appends a uuid per stub

    def command(self, backends: Path) -> list[str]:
        e = self.endpoints
        cmd = [str(self.install.binary), f"--model-repository={self.repo}",
               f"--backend-directory={backends}",
               "--model-control-mode=none",
               *self._restricted_args(),
               "--grpc-keepalive-permit-without-calls=true",
               f"--grpc-http2-min-recv-ping-interval-without-data={KEEPALIVE_MS // 2}",
               "--exit-timeout-secs=10", f"--log-verbose={self.log_verbose}",
               "--grpc-infer-allocation-pool-size=0",   # keeps no large request's memory
               f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
               f"--grpc-address={e.server_grpc[0]}", f"--grpc-port={e.server_grpc[1]}",
               *(self.grpc_tls.server_args() if self.grpc_tls else [])]
        if self.env.get(log_format.FORMAT_ENV) == "json":   # serve --log-format json
            cmd.append("--log-format=ISO8601")
        if e.http_port is None:
            cmd.append("--allow-http=false")
        else:
            cmd += [f"--http-address={e.server_http[0]}", f"--http-port={e.server_http[1]}"]
        if e.metrics_port is None:
            cmd.append("--allow-metrics=false")
        else:
            cmd += [f"--metrics-address={e.server_metrics[0]}",
                    f"--metrics-port={e.server_metrics[1]}"]
        return cmd

    @staticmethod
    def _restricted_args() -> list[str]:
        value = f"{','.join(RESTRICTED_APIS)}:{RESTRICTED_HEADER}={secrets.token_hex(16)}"
        return [f"--http-restricted-api={value}", f"--grpc-restricted-protocol={value}"]

    def start(self) -> None:
        backends = prepare_backends(self.install, self.work_dir)
        shm.sweep()
        if self.private_shm:
            self.host_shm.mkdir(mode=0o700, exist_ok=True)
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            self.command(backends), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=self.env, cwd=self.work_dir, start_new_session=True,
            preexec_fn=partial(_before_exec, self.cpus,
                               str(self.host_shm) if self.private_shm else None))
        log.close()

    def wait_ready(self, timeout: float = 300.0, cancel: threading.Event | None = None,
                   on_loaded: Callable[[str], None] | None = None) -> bool:
        """Block until the server reports ready (True) or ``cancel`` is set (False).

        ``on_loaded(model)`` is called as each model finishes loading. A failure the log
        reports (a model that cannot load, a stub that cannot start, a port taken), a
        server that exits, or ``timeout`` raises :class:`UserError`: the cause on its
        first line, then the log's tail; a cause the next start need not meet (a stub Triton
        abandoned, :mod:`.stuck_start`; a server killed by a signal; a port picked behind
        the door, taken before tritonserver bound it) raises
        :class:`RetryableStart`. The caller stops the server.
        """
        if self.process is None:
            raise UserError("wait_ready before start")
        deadline = time.monotonic() + timeout
        log = server_log.LogFollower(self.log_path)
        watch = StartWatch(self.process.pid)
        while cancel is None or not cancel.is_set():
            for line in log.new_lines():
                watch.read(line)
                cause = server_log.fatal_cause(line)
                if cause:
                    raise self._failure(cause, self._kind_of(line))
                model = server_log.loaded_model(line)
                if model and on_loaded:
                    on_loaded(model)
            if self.process.poll() is not None:
                raise self._exited_early()
            stuck = watch.stuck()
            if stuck:
                raise self._abandoned(stuck, watch.stuck_after, log)
            if self.is_ready():
                return True
            if time.monotonic() > deadline:
                raise self._failure(f"tritonserver not ready after {timeout:.0f}s")
            time.sleep(0.25)
        return False

    def _kind_of(self, fatal_line: str) -> type[UserError]:
        """A port picked for tritonserver behind the door (never one a user chose) that
        something bound between the pick and tritonserver's bind is :class:`RetryableStart`:
        the next start picks others. Any other fatal line is a :class:`UserError`."""
        inner = (self.endpoints.inner_grpc_port, self.endpoints.inner_http_port,
                 self.endpoints.inner_metrics_port)
        taken = server_log.taken_port(fatal_line)
        return RetryableStart if taken is not None and taken in inner else UserError

    def _failure(self, cause: str, kind: type[UserError] = UserError) -> UserError:
        return kind(f"{cause}\n--- tritonserver log (tail) ---\n{self.log_tail()}\n"
                    f"(full log: {self.log_path})")

    def _exited_early(self) -> UserError:
        code = self.process.poll()
        if code is not None and code < 0:     # e.g. aborted as a stub died while loading
            return self._failure(f"tritonserver was killed by signal {-code} before it was "
                                 f"ready", RetryableStart)
        return self._failure("tritonserver exited before it was ready")

    def _abandoned(self, stubs: list[Stub], after: float,
                   log: server_log.LogFollower) -> RetryableStart:
        """The error for stubs Triton gave up on (:mod:`.stuck_start`), with every thread's
        stack of each, which the stubs write to the log on ``STACKS_SIGNAL``."""
        for stub in stubs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stub.pid, STACKS_SIGNAL)
        time.sleep(STACKS_WAIT_SECONDS)
        stacks = "\n".join(log.new_lines())
        names = ", ".join(f"{s.instance} (pid {s.pid})" for s in stubs)
        return RetryableStart(
            f"Triton gave up on the stub of {names} during its start (a missed health check: "
            f"the host was busy) and waits for it to exit, which it never does: its "
            f"initialize finished {after:.0f}s ago and the model never loaded.\n"
            f"--- its threads ---\n{stacks}\n(full log: {self.log_path})")

    @property
    def local_host(self) -> str:
        """Where this host reaches the server's endpoints."""
        return reachable(self.endpoints.host)

    @property
    def grpc_url(self) -> str:
        """Where this host reaches tritonserver's own gRPC (behind the door: loopback)."""
        host, port = self.endpoints.server_grpc
        return f"{reachable(host)}:{port}"

    def is_ready(self) -> bool:
        host, port = self.endpoints.server_http
        if port is not None:
            try:
                url = f"http://{reachable(host)}:{port}/v2/health/ready"
                with urllib.request.urlopen(url, timeout=2) as resp:
                    return resp.status == 200
            except OSError:
                return False
        import tritonclient.grpc as grpcclient

        try:
            with grpcclient.InferenceServerClient(self.grpc_url,
                                                  **client_options(self.grpc_tls)) as client:
                return client.is_server_ready(client_timeout=2)
        except Exception:  # noqa: BLE001 - any failure means "not yet"
            return False

    @property
    def regions_dir(self) -> str:
        """Where the running server's Python-backend regions are, seen from this process."""
        return f"/proc/{self.process.pid}/root/dev/shm" if self.private_shm else shm.SHM_DIR

    def log_tail(self, lines: int = 20) -> str:
        try:
            return server_log.tail(self.log_path.read_text(errors="replace"), lines)
        except OSError:
            return "(no log)"

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds; returns the exit code."""
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(proc.pid, signal.SIGKILL)  # stubs left behind by a crashed server
        code = proc.wait()
        for name in os.listdir(shm.SHM_DIR):  # what a killed server could not unlink
            if name.startswith(self.shm_prefix):
                os.unlink(os.path.join(shm.SHM_DIR, name))
        shm.sweep()
        return code


def _before_exec(cpus: tuple[int, ...], host_shm: str | None) -> None:
    """In the child before exec: SIGTERM it if the process that started it dies (even by
    SIGKILL), so a killed `triton-disagg serve` never leaves a server behind; put it on
    ``cpus`` when given (exec and fork keep the mask); given ``host_shm``, give it a private
    ``/dev/shm`` with the host's at ``host_shm`` (:mod:`.private_shm`)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if cpus:
        os.sched_setaffinity(0, cpus)
    if host_shm is not None:
        private_shm.enter(host_shm)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass

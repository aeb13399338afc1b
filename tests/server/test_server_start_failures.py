"""A server that cannot start says why within seconds, the cause first.

Real tritonserver runs: a stub whose libpython is missing (the real stub with that
dependency renamed, as on a Debian machine without the libpython package) and a gRPC
port that something else holds. The checks ``serve`` makes before starting the server
are bypassed here, to prove the log watch catches what gets past them.
"""

from __future__ import annotations

import socket
import sys
import time
from dataclasses import replace

import pytest

from triton_disagg.config.disagg import default_config
from triton_disagg.errors import RetryableStart, UserError
from triton_disagg.triton import server_log
from triton_disagg.launch.deploy import free_ports
from triton_disagg.triton.render import render
from triton_disagg.triton.tritonserver import TritonServer, locate
from triton_disagg.triton.endpoints import Endpoints

VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


def _start(install, demo_engine, tmp_path, grpc_port=None) -> TritonServer:
    http, grpc = free_ports(2)
    repo = render("all", default_config(demo_engine), tmp_path / "repo")
    server = TritonServer(install, repo, Endpoints("127.0.0.1", http, grpc_port or grpc, None),
                          tmp_path)
    server.start()
    return server


def test_a_stub_that_cannot_start_fails_the_start_in_seconds(demo_engine, tmp_path):
    install = locate()
    broken = tmp_path / "stub"
    broken.write_bytes(install.stub.read_bytes().replace(f"libpython{VERSION}.so.1.0".encode(),
                                                         f"libpython{VERSION}.so.9.9".encode()))
    broken.chmod(0o755)
    server = _start(replace(install, stub=broken), demo_engine, tmp_path)
    started = time.monotonic()
    try:
        with pytest.raises(UserError) as info:
            server.wait_ready(timeout=120)
    finally:
        server.stop()
    assert time.monotonic() - started < 15.0
    first = str(info.value).splitlines()[0]
    assert first.startswith("Triton's Python backend stub cannot start: ")
    assert f"libpython{VERSION}.so.9.9" in first


def test_a_taken_port_fails_the_start_naming_it(demo_engine, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = _start(locate(), demo_engine, tmp_path, grpc_port=port)
        try:
            with pytest.raises(UserError) as info:
                server.wait_ready(timeout=120)
        finally:
            server.stop()
    first = str(info.value).splitlines()[0]
    assert first.startswith("GRPC endpoint failed to start: ") and f":{port}" in first
    assert not isinstance(info.value, RetryableStart)     # the user's port: not tried again


def test_a_taken_port_picked_behind_the_door_is_worth_another_start(demo_engine, tmp_path):
    """A CI run's tritonserver failed "Socket '127.0.0.1:22847' already in use" on an inner
    port picked behind the door: the next start picks others, so serve tries again."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        http, grpc, inner_http = free_ports(3)     # below the ephemeral range: never port
        repo = render("all", default_config(demo_engine), tmp_path / "repo")
        server = TritonServer(locate(), repo, Endpoints(
            "127.0.0.1", http, grpc, None, inner_grpc_port=port, inner_http_port=inner_http),
            tmp_path)
        server.start()
        try:
            with pytest.raises(RetryableStart) as info:
                server.wait_ready(timeout=120)
        finally:
            server.stop()
    assert str(info.value).startswith("GRPC endpoint failed to start: ")


def test_the_tail_drops_what_every_cpu_start_prints():
    log = "\n".join([
        'E1203 server.cc:241] "CudaDriverHelper has not been initialized."',
        "Error: Failed to initialize NVML",
        'W1203 metrics.cc:798] "DCGM unable to start: DCGM initialization error"',
        "| context | 1 | UNAVAILABLE: Internal: boom |",
        "E1203 model_lifecycle.cc:642] \"failed to load 'context' version 1: Internal: "
        "ValueError: boom\\n\\nAt:\\n  model.py(3): initialize\"",
    ])
    assert server_log.tail(log) == log.splitlines()[-1]
    assert server_log.fatal_cause(log.splitlines()[-1]) == \
        "model 'context' failed to load: ValueError: boom"
    assert server_log.loaded_model('I1203 model_lifecycle.cc:839] "successfully loaded '
                                   "'preprocessing'\"") == "preprocessing"

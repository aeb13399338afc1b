"""Where the HTTP front listens (launch/front_process.py): flag, config key, default per
role, which roles and modes run the whole front and which its health-only mode, and the
one-line refusals."""

from __future__ import annotations

import socket

import pytest

from config_files import assert_one_line_error, config_writer
from triton_disagg.config.disagg import load_config
from triton_disagg.errors import UserError
from triton_disagg.launch.deploy import PortFlags, endpoints_for
from triton_disagg.launch.front_process import check_front_port, front_port, health_only
from triton_disagg.triton.endpoints import Endpoints

ENGINE = "model: {engine: engines/demo}\n"


@pytest.fixture
def write(tmp_path):
    return config_writer(tmp_path, ENGINE)


def test_flag_then_config_then_url_then_default(write):
    plain = load_config(write(""))
    keyed = load_config(write("scheduler_server: {front_port: 9090, url: \"localhost:9191\"}\n"))
    at_url = load_config(write("scheduler_server: {url: \"localhost:9191\"}\n"))
    assert front_port("all", plain, None) == 8080          # serve all: Triton keeps 8000-8002
    assert front_port("scheduler", plain, None) == 8002    # the guide's scheduler port
    assert front_port("scheduler", keyed, None) == 9090
    assert front_port("all", keyed, 7070) == 7070
    assert front_port("scheduler", at_url, None) == front_port("all", at_url, None) == 9191


def test_serve_alls_tritonserver_keeps_its_ports_unless_the_scheduler_has_a_url(write):
    plain = load_config(write(""))
    at_url = load_config(write("scheduler_server: {url: \"localhost:9191\"}\n"))
    assert endpoints_for("all", plain, PortFlags()) == Endpoints("127.0.0.1", 8000, 8001, 8002)
    assert endpoints_for("scheduler", plain, PortFlags()).http_port == 8003
    assert endpoints_for("all", at_url, PortFlags()) == Endpoints("127.0.0.1", 9192, 9193, 9194)
    keyed = load_config(write("scheduler_server: {url: \"localhost:9191\", grpc_port: 7001, "
                              "http_port: 7000}\n"))
    assert endpoints_for("scheduler", keyed, PortFlags(metrics=7002)) == \
        Endpoints("127.0.0.1", 7000, 7001, 7002)


def test_ports_all_given_need_no_room_after_the_deployments_last(write):
    """With Triton's three ports given, none is derived from the deployment's, so a url port
    near 65535 is no error (it is, one line, when a port must follow it)."""
    high = load_config(write("scheduler_server: {url: \"localhost:65534\"}\n"))
    assert endpoints_for("scheduler", high, PortFlags(http=7000, grpc=7001, metrics=7002)) == \
        Endpoints("127.0.0.1", 7000, 7001, 7002)
    with pytest.raises(UserError, match="--http-port, --grpc-port and --metrics-port"):
        endpoints_for("scheduler", high, PortFlags(http=7000, grpc=7001))


def test_every_role_has_a_front_on_ports_that_do_not_collide_on_one_host(write):
    plain = load_config(write(""))
    defaults = {role: front_port(role, plain, None) for role in ("scheduler", "context",
                                                                  "generation")}
    assert defaults == {"scheduler": 8002, "context": 8081, "generation": 8082}
    keyed = load_config(write("context_server: {front_port: 9091}\n"
                              "generation_server: {front_port: 9092}\n"))
    assert front_port("context", keyed, None) == 9091
    assert front_port("generation", keyed, 7070) == 7070
    assert front_port("all", keyed, None) == 8080     # the scheduler's key, none here


def test_health_only_for_context_generation_and_without_decoupled_mode(write):
    config = load_config(write(""))
    assert [health_only(role, config) for role in ("all", "scheduler", "context",
                                                   "generation")] == [False, False, True, True]
    assert health_only("all", load_config(write("decoupled_mode: false\n")))


@pytest.mark.parametrize("value", ["0", "70000", "'8080'"])
@pytest.mark.parametrize("key", ["front_port", "grpc_port"])
def test_bad_front_port_is_one_line(write, value, key):
    assert_one_line_error(write(f"scheduler_server: {{{key}: {value}}}\n"),
                          [f"scheduler_server.{key}", "port number"])


@pytest.mark.parametrize("role", ["context", "generation"])
def test_a_roles_bad_front_port_is_one_line(write, role):
    assert_one_line_error(write(f"{role}_server: {{front_port: 0}}\n"),
                          [f"{role}_server.front_port", "port number"])


def test_a_taken_or_colliding_port_is_refused():
    endpoints = Endpoints("127.0.0.1", 18000, 18001, 18002)
    with pytest.raises(UserError, match="also tritonserver's"):
        check_front_port("127.0.0.1", 18001, endpoints)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(UserError, match="not free.*--front-port"):
            check_front_port("127.0.0.1", taken.getsockname()[1], endpoints)


def test_every_roles_tritonserver_moves_behind_the_doors_on_loopback():
    from triton_disagg.launch.deploy import LOWEST_PICKED_PORT, behind_door
    from triton_disagg.launch.front_process import door_flags, door_ports

    public = Endpoints("0.0.0.0", 8000, 8001, 8002)
    assert door_flags(public) == [] and door_ports(public) == ()
    door = behind_door(public)
    assert (door.host, door.http_port, door.grpc_port, door.metrics_port) == \
        ("0.0.0.0", 8000, 8001, 8002)
    inner = (door.inner_grpc_port, door.inner_http_port, door.inner_metrics_port)
    assert len(set(inner)) == 3 and min(inner) >= LOWEST_PICKED_PORT
    assert door_flags(door) == ["--door-grpc", f"8001:{door.inner_grpc_port}",
                                "--door-http", f"8000:{door.inner_http_port}",
                                "--door-metrics", f"8002:{door.inner_metrics_port}"]
    assert door_flags(door, peers=True)[:3] == ["--door-grpc", f"8001:{door.inner_grpc_port}",
                                                "--door-peers"]     # context, generation
    assert door_ports(door) == (8001, 8000, 8002)
    assert (door.server_grpc, door.server_http, door.server_metrics) == \
        (("127.0.0.1", door.inner_grpc_port), ("127.0.0.1", door.inner_http_port),
         ("127.0.0.1", door.inner_metrics_port))
    assert door.server_metrics_url == f"http://127.0.0.1:{door.inner_metrics_port}"
    grpc_only = behind_door(Endpoints("127.0.0.1", None, 8001, None))
    assert grpc_only.inner_http_port is None and grpc_only.inner_metrics_port is None
    assert door_flags(grpc_only) == ["--door-grpc", f"8001:{grpc_only.inner_grpc_port}"]
    assert grpc_only.server_metrics_url is None and door_ports(grpc_only) == (8001,)


def test_serve_all_keeps_ucx_on_shared_memory_and_agents_match_it(monkeypatch):
    """rev27f M2: serve all's NIXL peers are stubs of one tritonserver: UCX on shared memory
    alone (no TCP listener), whose endpoints have no peer failure handler."""
    from triton_disagg.kv.nixl_agent import error_handling_mode
    from triton_disagg.launch.deploy import ucx_env

    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert ucx_env("all", "127.0.0.1") == {"UCX_TLS": "self,sm", "UCX_NET_DEVICES": "lo"}
    assert ucx_env("all", "0.0.0.0", gpus=True) == {"UCX_TLS": "self,sm,cuda_copy,cuda_ipc"}
    assert ucx_env("context", "127.0.0.1") == {"UCX_NET_DEVICES": "lo"}
    assert ucx_env("context", "10.0.0.2") == {}
    monkeypatch.setenv("UCX_TLS", "tcp")
    assert ucx_env("all", "127.0.0.1") == {"UCX_NET_DEVICES": "lo"}   # the user's TLS wins
    assert [error_handling_mode(t) for t in ("self,sm", "self,sm,cuda_copy,cuda_ipc", None,
                                             "tcp", "self,sm,tcp", "^tcp")] == \
        ["none", "none", "peer", "peer", "peer", "peer"]

"""The ports tests and benches pick for the servers they start (launch/deploy.py
``free_ports``, ``free_port_run``) lie below the kernel's ephemeral range, so a socket the
kernel numbers itself (a UCX listener in a stub of a server starting beside them, an
outgoing connection) never takes one between the pick and the server's bind (a CI run's
tritonserver failed "Socket ... already in use" on a port picked by binding port 0)."""

from __future__ import annotations

from launch.deploy import LOWEST_PICKED_PORT, _ephemeral_start, free_port_run, free_ports


def test_picked_ports_are_below_the_ephemeral_range_and_distinct():
    first = _ephemeral_start()
    ports = free_ports(16)
    assert len(set(ports)) == 16
    assert all(LOWEST_PICKED_PORT <= port < first for port in ports), (ports, first)
    base = free_port_run(4)
    assert LOWEST_PICKED_PORT <= base and base + 4 <= first


def test_the_ephemeral_start_is_read_from_the_kernel(tmp_path):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    assert _ephemeral_start(str(ranges)) == 40000
    assert _ephemeral_start(str(tmp_path / "absent")) == 32768


def test_ports_picked_behind_the_door_avoid_the_public_ones(monkeypatch):
    """A CI run's tritonserver failed "Socket ... already in use": an inner port picked
    free was one of the same serve's public ports, which the doors bind after the pick."""
    from launch import deploy
    from triton_disagg.triton.endpoints import Endpoints

    offered = iter([8000, 8001, 20001, 8002, 8003, 20002, 20003])
    monkeypatch.setattr(deploy, "free_port_run", lambda count, host: next(offered))
    door = deploy.behind_door(Endpoints("127.0.0.1", 8000, 8001, 8002), promised=(8003,))
    assert (door.inner_grpc_port, door.inner_http_port, door.inner_metrics_port) == \
        (20001, 20002, 20003)

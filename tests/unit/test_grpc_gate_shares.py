"""The gRPC door's connection gate (triton_disagg/front/grpc_admission.py) by address: who
takes whose place at the cap when addresses hold unequal shares. The gate alone, with
stand-in sockets (no pipe, no grpc), so the order of arrivals is exact."""

from __future__ import annotations

import asyncio
import time

from triton_disagg.front import grpc_admission


class _Transport:
    """A client socket's stand-in for the gate's bookkeeping: an address and an abort."""

    def __init__(self, address: str):
        self.address, self.aborted = address, False

    def get_extra_info(self, name, default=None):
        return (self.address, 1) if name == "peername" else default

    def set_write_buffer_limits(self, high=None):
        pass

    def abort(self):
        self.aborted = True


class _Clock:
    def now(self) -> float:
        return time.monotonic()


def _arrive(gate: grpc_admission.ConnectionGate, address: str) -> grpc_admission.GatedConnection:
    """A connection from ``address`` at the gate; admitted, it has spoken (no pipe here)."""
    connection = grpc_admission.GatedConnection(gate)
    connection.connection_made(_Transport(address))
    if connection.client is not None:
        connection.spoke = True
        gate.unsilent(connection)
    return connection


def _idle(gate: grpc_admission.ConnectionGate, address: str, count: int) -> list:
    """``count`` connections from ``address`` that worked a minute ago, idle since."""
    connections = [_arrive(gate, address) for _ in range(count)]
    for connection in connections:
        connection.worked, connection.moved = True, _Clock().now() - 60
    return connections


def _working(gate: grpc_admission.ConnectionGate, address: str, count: int) -> list:
    """``count`` connections from ``address``, each with a call at work."""
    connections = [_arrive(gate, address) for _ in range(count)]
    for connection in connections:
        connection.seated(_WorkingCall())
    return connections


class _WorkingCall:
    """A call at work: its seat may not be taken (``rank()`` None)."""

    connection = None

    def rank(self):
        return None


def test_an_address_whose_oldest_work_cannot_block_the_look_at_it():
    """rev27p P-1: 8 connections of one address working every second are its 8 oldest, so
    every look at that address's oldest (``_idlest``) found none to take; its flood of
    connections that each sent a byte then drew the ranking the gate keeps for a tenth of a
    second dry, and a newcomer of another address was refused. Now a look moves those it
    cannot take to the back: every newcomer of the other address gets in, and the working
    connections keep their places."""
    async def main():
        gate = grpc_admission.ConnectionGate("127.0.0.1", 0, 0, 16, clock=_Clock())
        working = _working(gate, "10.0.0.1", 8)
        admitted = 0
        for i in range(400):                           # the flood, another newcomer beside
            _arrive(gate, "10.0.0.1")
            if i % 20 == 19:                           # a client that calls and leaves
                victim = _arrive(gate, "10.0.0.2")
                admitted += victim.client is not None
                victim.end()
        assert admitted == 20
        assert all(connection.client is not None for connection in working)
    asyncio.run(main())


def test_an_address_over_its_share_never_takes_another_addresss_idle_place():
    """rev27q Q-1: a newcomer of an address over its share whose look at its own
    connections found only working ones ranked every connection, and the ranking (kept for
    a tenth of a second, its own flood's places gone from it) gave it another address's
    idle connection: a stream idle 2 s was cut each time. Now a newcomer over its share
    takes a place of its own address, or of one holding more, else is closed: the idle
    place of an address holding fewer stays."""
    async def main():
        gate = grpc_admission.ConnectionGate("127.0.0.1", 0, 0, 16, clock=_Clock())
        idle, = _idle(gate, "10.0.0.2", 1)
        _working(gate, "10.0.0.1", 15)                           # the cap, all working
        newcomers = [_arrive(gate, "10.0.0.1") for _ in range(20)]
        assert idle.client is not None
        assert not any(newcomer.client for newcomer in newcomers) and gate.refused == 20
    asyncio.run(main())


def test_an_address_over_its_share_takes_an_idle_place_of_one_holding_more():
    """rev27r R-1: a newcomer over its share took only its own address's places, so a
    working address just over the average was refused every new connection while another
    held more places, all idle. Now it takes an idle place of the address holding the most
    when that holds more than its own."""
    async def main():
        gate = grpc_admission.ConnectionGate("127.0.0.1", 0, 0, 64, clock=_Clock())
        idle = _idle(gate, "10.0.0.1", 40)
        _arrive(gate, "10.0.0.3")
        _working(gate, "10.0.0.2", 23)
        newcomer = _arrive(gate, "10.0.0.2")
        assert newcomer.client is not None
        assert sum(connection.client is None for connection in idle) == 1
    asyncio.run(main())


def test_an_idle_address_behind_a_working_busiest_one_never_caps_a_working_one():
    """rev27s S-1: room for a newcomer over its share was looked for only in the address
    holding the most, so while that one's connections all worked, a third address holding
    more idle places than the newcomer's still refused each of its new connections. Now any
    address holding more gives up an idle place (the one holding the most first), until it
    holds no more than the newcomer's."""
    async def main():
        gate = grpc_admission.ConnectionGate("127.0.0.1", 0, 0, 64, clock=_Clock())
        _working(gate, "10.0.0.1", 25)                           # the busiest, all working
        idle = _idle(gate, "10.0.0.2", 20)
        _arrive(gate, "10.0.0.4")
        _working(gate, "10.0.0.3", 18)
        newcomer = _arrive(gate, "10.0.0.3")
        assert newcomer.client is not None
        newcomer.seated(_WorkingCall())
        assert _arrive(gate, "10.0.0.3").client is None        # 19 places each: no more
        assert sum(connection.client is None for connection in idle) == 1
    asyncio.run(main())

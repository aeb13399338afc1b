"""Slow clients of the HTTP front (triton_disagg/front/http_gates.py, openai_api.py's
read_json), served as its process serves it: headers trickled past ``idle_timeout_seconds``
are cut off, a body past ``body_timeout_seconds`` is a 408, and a connection whose client
does not take what was written to it within ``write_timeout_seconds`` is dropped, whatever
the route wrote and also while it closes, its request ended and its slot given back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import pytest
from aiohttp import web

from scripted_relay import BODY, WORDS, ScriptedRelay, raw, response, served
from triton_disagg.config.front_section import FrontConfig
from triton_disagg.front.http_gates import CappedRunner


def test_trickled_headers_are_cut_off_at_the_idle_timeout(demo_engine):
    async def main():
        front = FrontConfig(idle_timeout_seconds=0.5)
        async with served(demo_engine, ScriptedRelay(WORDS), front) as port:
            reader, writer = await raw(port, b"POST /v1/completions HTTP/1.1\r\n")
            began = time.monotonic()
            with contextlib.suppress(ConnectionError):
                for byte in b"Host: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0.1)
                    if reader.at_eof() or writer.is_closing():
                        break
            assert await asyncio.wait_for(reader.read(), 5) == b""     # closed by the server
            assert time.monotonic() - began < 3
    asyncio.run(main())


def test_a_trickled_body_gets_408_at_the_body_timeout(demo_engine):
    async def main():
        front = FrontConfig(body_timeout_seconds=0.5)
        async with served(demo_engine, ScriptedRelay(WORDS), front) as port:
            reader, writer = await raw(port, b"POST /v1/completions HTTP/1.1\r\n"
                                             b"Host: 127.0.0.1\r\nContent-Length: 1000\r\n"
                                             b"Content-Type: application/json\r\n\r\n{")
            began = time.monotonic()
            head = await asyncio.wait_for(reader.readline(), 5)
            assert head.startswith(b"HTTP/1.1 408") and time.monotonic() - began < 3
            writer.close()
    asyncio.run(main())


def test_a_client_that_never_reads_its_stream_is_dropped_and_its_request_ended(demo_engine):
    relay = ScriptedRelay([response("x" * 2**16, 1, 1)] * 2000)     # up to 128 MiB of text

    async def main():
        async with served(demo_engine, relay, FrontConfig(write_timeout_seconds=0.5)) as port:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            body = json.dumps({**BODY, "stream": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await relay.until_left()                    # it never read a byte
            sock.close()
    asyncio.run(main())

def test_a_whole_answer_the_client_never_reads_gives_its_connection_back(demo_engine):
    """A non-streamed answer is written within ``write_timeout_seconds`` too: a client that
    never reads it (issue 27 re-review F1) is dropped, and its connection is free again."""
    relay = ScriptedRelay([response("x" * 2**20, 1, i + 1) for i in range(8)]
                          + [response("", 1, 9, finish_reason="length")])   # 8 MiB of text

    async def main():
        front = FrontConfig(max_connections=1, write_timeout_seconds=0.5)
        async with served(demo_engine, relay, front) as port:
            await asyncio.sleep(0.5)                    # served's probe connection is gone
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            body = json.dumps(BODY).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await asyncio.sleep(3.0)                    # it never read a byte
            assert sock.recv(12, socket.MSG_PEEK) == b"HTTP/1.1 200"   # answered, unread
            reader, writer = await raw(port, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head = await asyncio.wait_for(reader.readline(), 5)
            assert head.startswith(b"HTTP/1.1 200"), head   # not 503: the slot came back
            writer.close()
            sock.close()
    asyncio.run(main())


def test_pipelined_gets_never_read_are_dropped_at_the_write_timeout(demo_engine):
    """Every route's answer is bounded by ``write_timeout_seconds``, not only generation's
    (review item 0): a socket that pipelines ~1 MB of ``GET /openapi.json`` and never reads
    is dropped (counted in /metrics), and its connection slot serves the next client."""
    async def main():
        front = FrontConfig(max_connections=1, write_timeout_seconds=0.5)
        async with served(demo_engine, ScriptedRelay(WORDS), front) as port:
            await asyncio.sleep(0.5)                    # served's probe connection is gone
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.setblocking(False)
            request = b"GET /openapi.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 10
            with contextlib.suppress(BlockingIOError):
                for _ in range(2000):
                    sock.send(request)
            await asyncio.sleep(3.0)                    # it never read a byte
            reader, writer = await raw(port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                              b"Connection: close\r\n\r\n")
            text = (await asyncio.wait_for(reader.read(), 5)).decode()
            assert text.startswith("HTTP/1.1 200"), text    # not 503: the slot came back
            assert "disagg_front_stalled_connections_total 1" in text, text
            writer.close()
            sock.close()
    asyncio.run(main())


# ---- a closing connection's unread tail (the runner alone, a plain aiohttp app) ---------

WRITE_TIMEOUT = 0.5


@pytest.mark.parametrize("size", [48 * 2**10, 1_750_000])
def test_a_closing_answer_nobody_reads_gives_its_connection_back(size):
    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * size)

    async def main():
        app = web.Application()
        app.router.add_get("/big", big)
        stalled: list[int] = []
        runner = CappedRunner(app, 2, WRITE_TIMEOUT, on_stalled=lambda: stalled.append(1),
                              handler_cancellation=True, keepalive_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        loop, readers = asyncio.get_running_loop(), []
        try:
            for _ in range(2):                  # both slots: answers nobody reads
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
                sock.setblocking(False)
                await loop.sock_connect(sock, ("127.0.0.1", port))
                await loop.sock_sendall(sock, b"GET /big HTTP/1.1\r\nHost: x\r\n"
                                              b"Connection: close\r\n\r\n")
                readers.append(sock)
            for _ in range(100):                # until both are gone (bounded wait)
                if runner.server.open == 0:
                    break
                await asyncio.sleep(0.05)
            # gone: sent whole into the kernel's buffers, or dropped at the write timeout
            assert runner.server.open == 0, (runner.server.open, len(stalled))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            status = await asyncio.wait_for(reader.readline(), 5)
            assert status.startswith(b"HTTP/1.1 200"), status     # not 503: slots freed
            writer.close()
        finally:
            for sock in readers:
                sock.close()
            await runner.cleanup()
    asyncio.run(main())

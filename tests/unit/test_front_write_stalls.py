"""The HTTP front's connection protocol drops a connection whose answer its client does not
take within the write timeout, at the socket level and whatever wrote it (issue 27's last
reviews): also while the connection is closing, after a ``Connection: close`` answer whose
tail nobody reads (asyncio would wait for ever to send it) and below the transport's
default 64 KiB high water mark (writing never paused there; whether the kernel's buffers
take such an answer whole depends on the host)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from triton_disagg.front.http_gates import CappedRunner

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

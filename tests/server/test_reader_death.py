"""A reader that dies takes its process down, as a model instance's stub would go: a real
token inbox with the default ``on_death``, in a process of its own, hits a bug on a valid
event; the process exits with ``EXIT_READER_DIED`` and says why, which ``serve`` sees as a
dead stub and answers with a restart (tests/server/test_stub_death.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from triton_disagg.readers import EXIT_READER_DIED

PROCESS = textwrap.dedent("""
    import asyncio, logging, time
    import zmq
    from triton_disagg import token_wire
    from triton_disagg.front.token_inbox import TokenInbox, TokenStream
    from triton_disagg.engine.sequence import TokenEvent
    from triton_disagg.zmq_endpoints import push_socket

    logging.basicConfig()

    def broken(self, event):
        raise RuntimeError("a bug in the reader")
    TokenStream.deliver = broken

    async def main():
        inbox = TokenInbox(None, 30.0)
        with inbox.open("r") as stream:
            push = push_socket(zmq.Context.instance(), inbox.address, 10)
            push.send(token_wire.encode_events([TokenEvent("r", [5], key=stream.key)]))
            await asyncio.sleep(30)
    asyncio.run(main())
""")


def test_a_reader_that_dies_ends_its_process_with_the_reason():
    done = subprocess.run([sys.executable, "-c", PROCESS], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == EXIT_READER_DIED, done.stderr
    assert "orchestrator token reader died (RuntimeError: a bug in the reader)" in done.stderr
    assert "serve restarts the server" in done.stderr

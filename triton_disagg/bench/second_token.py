"""`bench overlap`'s client: each prompt streamed on its own gRPC stream, one at a time, its
first two responses timed and its text kept.

:func:`replies` runs it in this process (one host). A server on a network-namespace host
is reached only from inside a namespace, so ``python -m triton_disagg.bench.second_token``
runs it there as a worker (:class:`Worker` drives it): one JSON request per stdin line
(``{"url", "prompts", "max_tokens"}``), one JSON answer per stdout line (the replies, or
``{"error": ...}``), until stdin closes.

Invariant: a reply's times are ``time.perf_counter`` seconds from its request's send, on
the client's host, so they include the front end, both Triton hops and the token path.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Sequence

from triton_disagg.errors import UserError


@dataclass(frozen=True)
class TimedReply:
    first: float       # seconds from the send to the first response
    second: float      # ... to the second
    text: str          # every response's text, joined


async def _replies(url: str, prompts: Sequence[str], max_tokens: int) -> list[TimedReply]:
    import tritonclient.grpc.aio as aio

    from triton_disagg.clients.stream import GenerateRequest, grpc_generate

    out = []
    async with aio.InferenceServerClient(url) as client:
        for prompt in prompts:
            m = await grpc_generate(client, GenerateRequest(prompt, max_tokens))
            if len(m.arrivals) < 2:
                raise UserError("bench overlap: a reply came in one response; the second "
                                "token is needed (is stream_interval 1?)")
            out.append(TimedReply(m.arrivals[0] - m.start, m.arrivals[1] - m.start,
                                  "".join(m.text)))
    return out


def replies(url: str, prompts: Sequence[str], max_tokens: int) -> list[TimedReply]:
    """Stream ``prompts`` to the ensemble at ``url`` (gRPC host:port), one at a time."""
    return asyncio.run(_replies(url, prompts, max_tokens))


class Worker:
    """:func:`replies` through a worker process (this module's ``__main__``), started by the
    caller wherever the servers can be reached; the caller stops it."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc           # text mode, stdin and stdout pipes

    def __call__(self, url: str, prompts: Sequence[str], max_tokens: int) -> list[TimedReply]:
        self.proc.stdin.write(json.dumps({"url": url, "prompts": list(prompts),
                                          "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise UserError(f"bench overlap: the client worker (pid {self.proc.pid}) exited "
                            f"with code {self.proc.wait()}")
        answer = json.loads(line)
        if isinstance(answer, dict):
            raise UserError(f"bench overlap: {answer['error']}")
        return [TimedReply(**r) for r in answer]


def main() -> None:
    for line in sys.stdin:
        ask = json.loads(line)
        try:
            answer = [asdict(r) for r in replies(ask["url"], ask["prompts"], ask["max_tokens"])]
        except Exception as exc:          # told to the caller, which fails the bench with it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()

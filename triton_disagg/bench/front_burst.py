"""The HTTP front's admission cap under a burst: do clients past the cap get their 429/503
quickly, and do admitted requests keep their time to first token?

``python -m triton_disagg.bench.front_burst --front http://127.0.0.1:8080 --model NAME``
against a running ``serve all|scheduler`` whose ``front.max_concurrent_requests`` is
``--cap``. Two phases of ``--seconds`` each, loopback only:

1. unloaded: ``--cap`` clients keep the cap full with streamed completions of
   ``--max-tokens`` tokens, one after another;
2. burst: the same, plus ``--burst`` clients that all send at once every ``--every`` s.

Printed (one JSON object): per phase the TTFT (first content chunk) of the cap-filling
clients' requests, and for the burst phase also of every admitted request (the burst's own
that found a slot free wait behind the rest of their burst), the refusals (429/503) with
their latency, and the ratios of the TTFT p50s to the unloaded one. The refusals must be
quick and the burst's TTFT p50 within 2x the unloaded one (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import aiohttp

RETRY_SECONDS = 0.01       # a cap-filling client refused (a burst took its slot) retries after


@dataclass
class Tally:
    ttft: list[float] = field(default_factory=list)          # admitted requests, seconds
    refused: list[float] = field(default_factory=list)       # 429/503 answers, seconds
    other: dict[int, int] = field(default_factory=dict)      # any other status -> count


async def _one(session: aiohttp.ClientSession, url: str, body: dict, tally: Tally) -> None:
    began = time.monotonic()
    async with session.post(url, json=body) as resp:
        if resp.status in (429, 503):
            await resp.read()
            tally.refused.append(time.monotonic() - began)
            return
        if resp.status != 200:
            tally.other[resp.status] = tally.other.get(resp.status, 0) + 1
            await resp.read()
            return
        first = None
        async for line in resp.content:
            if first is None and line.startswith(b"data: {") and b'"text": ""' not in line:
                first = time.monotonic() - began
        if first is not None:
            tally.ttft.append(first)


async def _keep_full(session, url: str, body: dict, until: float, tally: Tally) -> None:
    while time.monotonic() < until:
        refused = len(tally.refused)
        await _one(session, url, body, tally)
        if len(tally.refused) > refused:        # a burst request took the slot: try again
            await asyncio.sleep(RETRY_SECONDS)


async def _bursts(session, url: str, body: dict, until: float, size: int, every: float,
                  tally: Tally) -> None:
    while time.monotonic() < until:
        began = time.monotonic()
        await asyncio.gather(*(_one(session, url, body, tally) for _ in range(size)))
        await asyncio.sleep(max(0.0, every - (time.monotonic() - began)))


async def _phase(args, burst: int) -> tuple[Tally, Tally]:
    url = f"{args.front}/v1/completions"
    body = {"model": args.model, "prompt": "The quick brown fox", "max_tokens": args.max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}
    steady, flood = Tally(), Tally()
    until = time.monotonic() + args.seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = [_keep_full(session, url, body, until, steady) for _ in range(args.cap)]
        if burst:
            tasks.append(_bursts(session, url, body, until, burst, args.every, flood))
        await asyncio.gather(*tasks)
    return steady, flood


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)


def _ms(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": _q(values, 0.5), "p90_ms": _q(values, 0.9),
            "p99_ms": _q(values, 0.99), "max_ms": _q(values, 1.0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m triton_disagg.bench.front_burst",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--front", required=True, help="the front's URL, http://127.0.0.1:PORT")
    p.add_argument("--model", required=True, help="the model id the front serves")
    p.add_argument("--cap", type=int, default=4, help="the front's max_concurrent_requests")
    p.add_argument("--burst", type=int, default=256, help="clients per burst")
    p.add_argument("--every", type=float, default=0.5, help="seconds between bursts")
    p.add_argument("--seconds", type=float, default=20.0, help="per phase")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)
    unloaded, _ = asyncio.run(_phase(args, 0))
    steady, flood = asyncio.run(_phase(args, args.burst))
    base = statistics.median(unloaded.ttft)
    print(json.dumps({
        "unloaded_ttft": _ms(unloaded.ttft), "burst_ttft_cap_fillers": _ms(steady.ttft),
        "burst_ttft_all_admitted": _ms(steady.ttft + flood.ttft),
        "burst_refused": _ms(flood.refused), "cap_fillers_refused": len(steady.refused),
        "burst_admitted": len(flood.ttft), "other_statuses": {**steady.other, **flood.other},
        "ttft_ratio_p50_cap_fillers": round(statistics.median(steady.ttft) / base, 2),
        "ttft_ratio_p50_all_admitted": round(
            statistics.median(steady.ttft + flood.ttft) / base, 2)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

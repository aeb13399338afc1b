"""`triton-disagg bench handoff`: the KV handoff's latency and bandwidth per strategy and
prompt length, from the server's own ``disagg_kv_transfer_seconds`` histogram, beside a
single-thread memcpy of the same bytes and ``process_vm_readv`` of them from another
process (the kernel copy a NIXL READ rides on within one host). :func:`markdown` says
what the figures include.

Invariant: a row's figures are one server's counters between two scrapes around that
row's requests only; p50 is a bucket bound of the histogram, never an interpolation;
both copy figures time the row's bytes per handoff with one harness
(:func:`triton_disagg.bench.copy_timing.best_gbps`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from triton_disagg.bench.args import add_engine_arg, bench_engine, cpus_arg, number_list
from triton_disagg.bench.report import progress, publish, shown_path
from triton_disagg.errors import UserError
from triton_disagg.kv.connector import STRATEGIES
from triton_disagg.kv.connector import strategy as kv_strategy
WARMUP_REQUESTS = 5
KV_MAX_SIZE = "64MB"     # per pool: the demo engine's 2,048-token sequence needs 8 MiB


def add_handoff_parser(kinds) -> None:
    p = kinds.add_parser(
        "handoff", help="KV handoff latency and bandwidth per strategy and prompt length, from "
                        "the server's own histogram, against memcpy and process_vm_readv")
    add_engine_arg(p)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--prompt-tokens", default="64,2000", help="comma-separated lengths")
    p.add_argument("--requests", type=int, default=40, help="per length (default 40)")
    p.add_argument("--cpus", help="cores to serve on, e.g. 0,1 (default: all usable)")
    p.add_argument("--work-dir", type=Path, default=Path("work/bench"))
    p.add_argument("--output", type=Path, help="markdown file whose handoff section is replaced")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class Row:
    strategy: str
    tokens: int
    handoffs: int
    p50_le: float              # seconds: the bucket bound where the cumulative share reaches 50%
    mean_s: float
    bytes_per: float
    memcpy_gbps: float
    vm_readv_gbps: float | None     # None: the kernel refused process_vm_readv
    vm_readv_refused: str = ""      # why vm_readv_gbps is None

    @property
    def gbps(self) -> float:
        return self.bytes_per / self.mean_s / 1e9

    @property
    def of_memcpy(self) -> float:
        return self.gbps / self.memcpy_gbps

    @property
    def of_vm_readv(self) -> float | None:
        """Share of ``process_vm_readv``'s GB/s: the bound of a NIXL READ on one host, so
        direct_transfer's only (None for host_memory, or when it was refused)."""
        if not kv_strategy(self.strategy).reads_peer_memory or self.vm_readv_gbps is None:
            return None
        return self.gbps / self.vm_readv_gbps


def p50_bucket(cumulative: Sequence[tuple[float, float]]) -> float:
    """The first bound ``le`` whose cumulative count reaches half the total (the last
    pair, ``+Inf``). ``cumulative``: ``(le, count <= le)`` in rising ``le``."""
    total = cumulative[-1][1]
    if total <= 0:
        raise ValueError("no observations")
    return next(le for le, count in cumulative if 2 * count >= total)


def histogram_delta(before, after, name: str, **labels: str) -> tuple[list, float, float]:
    """``(cumulative [(le, count)], sum, count)`` of histogram ``name`` between two scrapes,
    summed over the series whose labels include ``labels``."""
    from triton_disagg.routing.scrape import delta

    want, buckets = set(labels.items()), {}
    for sign, samples in ((-1, before), (1, after)):
        for key, value in samples.get(f"{name}_bucket", {}).items():
            if want <= key:
                le = float(dict(key)["le"])
                buckets[le] = buckets.get(le, 0.0) + sign * value
    return (sorted(buckets.items()), delta(before, after, f"{name}_sum", **labels),
            delta(before, after, f"{name}_count", **labels))


def memcpy_gbps(nbytes: int, repeats: int = 50) -> float:
    """GB/s of a numpy copy of ``nbytes`` between two preallocated arrays (best of ``repeats``)."""
    import numpy as np

    from triton_disagg.bench.copy_timing import best_gbps

    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    return best_gbps(lambda: np.copyto(dst, src), nbytes, repeats)


def vm_readv_bound(nbytes: int) -> tuple[float | None, str]:
    """``(GB/s, "")`` of ``process_vm_readv`` of ``nbytes`` from a child process, or
    ``(None, why)`` when the kernel refuses it here."""
    from triton_disagg.bench.cross_process_copy import Refused, process_vm_readv_gbps

    try:
        return process_vm_readv_gbps(nbytes), ""
    except Refused as why:
        return None, str(why)


def exact_prompt(tokenizer, n: int, rng: random.Random) -> str:
    """Text that ``tokenizer`` encodes to exactly ``n`` tokens: corpus text's token ids
    cut to a prefix and decoded; the cut moves (nearest first), then the text changes,
    until the decoded prefix re-encodes to ``n`` ids."""
    from triton_disagg.clients.workload import make_prompt

    for _ in range(20):
        ids = tokenizer.encode(make_prompt(n * 2 + 16, rng))
        cuts = range(max(1, n - 16), min(len(ids), n + 16) + 1)
        for k in sorted(cuts, key=lambda k: abs(k - n)):
            text = tokenizer.decode(ids[:k])
            if len(tokenizer.encode(text)) == n:
                return text
    raise UserError(f"cannot build a prompt of exactly {n} tokens with this tokenizer")


def _generate(http: str, text: str) -> int:
    """POST one /generate (max_tokens 2); returns the server's num_input_tokens."""
    body = json.dumps({"text_input": text, "max_tokens": 2, "return_num_input_tokens": True})
    req = urllib.request.Request(f"{http}/v2/models/ensemble/generate", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        got = json.loads(resp.read())["num_input_tokens"]
    return int(got[0] if isinstance(got, list) else got)


@contextlib.contextmanager
def serving(strategy: str, engine: Path, cores: Sequence[int], work_dir: Path,
            overlap: bool = False, kv_max_size: str = KV_MAX_SIZE,
            stall_seconds: float = 30.0, runtime: str | None = None
            ) -> Iterator[tuple[str, str, str]]:
    """``serve all`` with ``strategy`` (and ``kv_cache.overlap_transfer`` when ``overlap``;
    ``stall_seconds``: the deadline of each call, e.g. a long prefill's; ``runtime``:
    ``model.runtime`` on the CPU, None for the default); yields ``(http url, metrics url,
    grpc address)``, stops on exit."""
    from triton_disagg.bench.serve_servers import placement
    from triton_disagg.config.disagg import parse_config
    from triton_disagg.config.host import check_host
    from triton_disagg.launch.deploy import free_ports, start
    from triton_disagg.triton.endpoints import Endpoints

    servers = placement("disaggregated", cores)
    servers["generation_server"]["stall_seconds"] = stall_seconds
    model = {"engine": str(engine)} | ({"runtime": runtime, "device": "cpu"} if runtime else {})
    config = parse_config({"model": model, **servers,
                           "kv_cache": {"strategy": strategy, "max_size": kv_max_size,
                                        "overlap_transfer": overlap}},
                          source=f"bench handoff ({strategy})")
    check_host(config)
    http, grpc, metrics = free_ports(3)
    server = start("all", config, Endpoints("127.0.0.1", http, grpc, metrics),
                   work_dir / (strategy + ("-overlap" if overlap else "")))
    try:
        server.wait_ready(300.0)
        yield f"http://127.0.0.1:{http}", f"http://127.0.0.1:{metrics}", f"127.0.0.1:{grpc}"
    finally:
        server.stop()


def measure(strategy: str, engine: Path, cores, work_dir: Path, prompts: dict[int, list[str]],
            say) -> list[Row]:
    from triton_disagg.routing.scrape import delta, scrape

    rows = []
    with serving(strategy, engine, cores, work_dir) as (http, metrics, _):
        for text in [t for texts in prompts.values() for t in texts[:WARMUP_REQUESTS]]:
            _generate(http, text)
        for tokens, texts in prompts.items():
            before = scrape(metrics)
            for text in texts[WARMUP_REQUESTS:]:
                if (got := _generate(http, text)) != tokens:
                    raise UserError(f"the server counted {got} prompt tokens, not {tokens}")
            after = scrape(metrics)
            cumulative, total_s, count = histogram_delta(
                before, after, "disagg_kv_transfer_seconds", strategy=strategy)
            nbytes = delta(before, after, "disagg_kv_transfer_bytes_total", strategy=strategy)
            if count != len(texts) - WARMUP_REQUESTS:
                raise UserError(f"{strategy}: {count:g} handoffs counted for "
                                f"{len(texts) - WARMUP_REQUESTS} requests")
            per = nbytes / count
            rows.append(Row(strategy, tokens, int(count), p50_bucket(cumulative), total_s / count,
                            per, memcpy_gbps(int(per)), *vm_readv_bound(int(per))))
            say(_row(rows[-1]))
    return rows


def _row(r: Row) -> str:
    vm_readv = "n/a" if r.vm_readv_gbps is None else f"{r.vm_readv_gbps:.1f}"
    of_vm_readv = "–" if r.of_vm_readv is None else f"{r.of_vm_readv:.1%}"
    return (f"| {r.strategy} | {r.tokens} | {r.handoffs} | ≤ {r.p50_le * 1e3:g} ms "
            f"| {r.mean_s * 1e3:.2f} ms | {r.bytes_per / 1024:.0f} | {r.gbps:.2f} "
            f"| {r.memcpy_gbps:.1f} | {r.of_memcpy:.1%} | {vm_readv} | {of_vm_readv} |")


def verdict(rows: Sequence[Row]) -> str:
    """Issue 9's direct_transfer targets, as far as ``rows`` measure them."""
    direct = {r.tokens: r for r in rows if kv_strategy(r.strategy).reads_peer_memory}
    said, holds = [], ("MISSES", "holds")
    if r := direct.get(64):
        said.append(f"p50 ≤ 2 ms at 64 tokens {holds[r.p50_le <= 0.002]} "
                    f"(≤ {r.p50_le * 1e3:g} ms)")
    if r := direct.get(2000):
        said.append(f"≥ 50% of memcpy at 2,000 tokens {holds[r.of_memcpy >= 0.5]} "
                    f"({r.of_memcpy:.1%})")
    return f"Issue 9's direct_transfer targets: {'; '.join(said)}." if said else ""


def markdown(rows: Sequence[Row], engine: str, cores: Sequence[int], requests: int) -> str:
    from triton_disagg.bench.serve_servers import placement

    where = {role: ",".join(map(str, server["cpus"]))
             for role, server in placement("disaggregated", cores).items()}
    lines = [
        f"`triton-disagg bench handoff`: `serve all` of `{engine}` (context on core(s) "
        f"{where['context_server']}, generation on {where['generation_server']}), one client "
        f"posting {requests} sequential HTTP `/generate` requests per prompt length (max_tokens "
        f"2) after {WARMUP_REQUESTS} warm-up requests per length. Figures are the deltas of the "
        "server's own `disagg_kv_transfer_seconds` histogram and `disagg_kv_transfer_bytes_total`"
        " around each length's requests: generation's fetch only (direct_transfer: the NIXL READ"
        " of the blocks, then of their ticket words, and any layout conversion; host_memory: "
        "the copy out of the staging area), not the client, HTTP or the context's export. p50 "
        "is the histogram's bucket bound where the cumulative share reaches 50%; mean = sum / "
        "count; GB/s = bytes per handoff / mean. memcpy: a single-thread numpy copy of the same "
        "byte count between two preallocated arrays, best of 50 after warm-up. On one host a "
        "NIXL READ of host memory is a `process_vm_readv` by UCX's cma transport; the "
        "process_vm_readv column is that syscall alone between two processes (the bench "
        "reading a child's buffer into its own) on the same byte count, timed as memcpy is "
        "(cache-hot, best of 50 after warm-up): the bound that transport sets, and "
        "direct_transfer's share of it.", "",
        "| strategy | prompt tokens | handoffs | p50 (bucket) | mean | KiB / handoff "
        "| GB/s | memcpy GB/s | % of memcpy | process_vm_readv GB/s | % of process_vm_readv |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    after = [f"process_vm_readv n/a: {why}."
             for why in dict.fromkeys(r.vm_readv_refused for r in rows) if why]
    after.append(verdict(rows))
    paragraphs = [line for text in after for line in ("", text)]
    return "\n".join(lines + [_row(r) for r in rows] + paragraphs).rstrip() + "\n"


def run(args: argparse.Namespace) -> int:
    from triton_disagg.front.tokenizer import Tokenizer

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not strategies or set(strategies) - set(STRATEGIES):
        raise UserError(f"--strategies: {args.strategies!r}; choose from {', '.join(STRATEGIES)}")
    lengths = number_list(args.prompt_tokens, "--prompt-tokens", int)
    if args.requests < 1:
        raise UserError(f"--requests: {args.requests} must be >= 1")
    cores = cpus_arg(args.cpus)

    say = progress("handoff")

    engine = bench_engine(args.engine, args.work_dir, say)
    tokenizer, rng = Tokenizer(engine), random.Random(0)
    prompts = {n: [exact_prompt(tokenizer, n, rng) for _ in range(WARMUP_REQUESTS + args.requests)]
               for n in lengths}
    rows = [row for strategy in strategies
            for row in measure(strategy, engine, cores, (args.work_dir / "handoff").resolve(),
                               prompts, say)]
    shown = shown_path(engine)
    body = markdown(rows, shown, cores, args.requests)
    publish(body, args.output, "handoff", "KV handoff latency and bandwidth", say)
    return 0

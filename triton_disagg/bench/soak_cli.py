"""`triton-disagg bench soak`: `serve all` under mixed load for minutes, per KV strategy.

Per strategy: start ``serve all -c`` (two generation instances) as a user would
(:mod:`.soak_server`); for ``--minutes`` run at once genai-perf back to back and locust
(:mod:`.soak_tools`), cancel clients and bad inputs (:mod:`.soak_clients`), while the
stubs' RSS is sampled (:mod:`.soak_watch`); wait for every client to end; wait for the
KV pools to empty; send one more request; stop the server and search its logs. Then
the table (:mod:`.soak_report`): printed, and with ``--output`` kept as the ``soak``
section of that file (``--overlap``: the ``soak-overlap`` section, each strategy named
``direct_transfer + overlap``). Exit 1 when a strategy fails a hard criterion.

Invariant: the soak depends on the public ensemble, Triton's endpoints, ``/metrics``,
the logs and the process table only, never on what runs inside the models.
"""

from __future__ import annotations

import argparse
import shutil
import threading
import time
from pathlib import Path

from triton_disagg.bench.args import add_engine_arg, bench_engine, cpus_arg
from triton_disagg.bench.report import progress, publish
from triton_disagg.errors import UserError

OVERLAP_SUFFIX = " + overlap"     # the strategy column's name for a run with --overlap


def add_soak_parser(kinds) -> None:
    p = kinds.add_parser(
        "soak", help="serve all under minutes of mixed load: no hang, crash, leak or growth",
        description="Run `serve all` with two generation instances per KV strategy under "
                    "genai-perf, locust, cancelling clients and bad inputs; report hung "
                    "requests, crashes, KV blocks left in use and stub memory over time.")
    p.add_argument("--minutes", type=float, default=10.0, help="load per strategy (default 10)")
    p.add_argument("--strategies", default="direct_transfer,host_memory")
    p.add_argument("--overlap", action="store_true",
                   help="serve with kv_cache.overlap_transfer: true (--overlap_kv_transfer: "
                        "generation READs a prompt's KV layer by layer during its prefill); "
                        "direct_transfer only")
    p.add_argument("--generation-instances", type=int, default=2)
    add_engine_arg(p, "work/bench")
    p.add_argument("--cpus", help="cores to place the models on, e.g. 0,1,2 (default: all "
                                  "usable; pinned only with one per instance plus one)")
    p.add_argument("--genai-perf", type=Path, help="genai-perf executable or its venv "
                                                   "(default /tmp/genai-perf-venv)")
    p.add_argument("--locust-users", type=int, default=4, help="half gRPC, half SSE (default 4)")
    p.add_argument("--cancel-clients", type=int, default=2, help="threads of cancelling clients")
    p.add_argument("--settle", type=float, default=60.0,
                   help="seconds to wait for the KV pools to empty after the load (default 60)")
    p.add_argument("--work-dir", type=Path, default=Path("work/soak"))
    p.add_argument("--output", type=Path, help="markdown file whose soak section is replaced")
    p.set_defaults(func=run)


_say = progress("soak")


def run(args: argparse.Namespace) -> int:
    from triton_disagg.bench.extras import require
    from triton_disagg.bench.soak_report import markdown
    from triton_disagg.bench.soak_tools import find_genai_perf
    from triton_disagg.kv.connector import STRATEGIES, strategy as kv_strategy

    require("locust", "bench soak runs locust")
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not strategies or set(strategies) - set(STRATEGIES):
        raise UserError(f"--strategies: {args.strategies!r}; choose from {', '.join(STRATEGIES)}")
    copying = [s for s in strategies if not kv_strategy(s).reads_peer_memory]
    if args.overlap and copying:
        raise UserError(f"--overlap needs --strategies direct_transfer: {', '.join(copying)} "
                        f"copies a prompt's KV once its prefill is done, nothing to overlap")
    if args.minutes <= 0 or args.generation_instances < 1 or args.locust_users < 1 \
            or args.cancel_clients < 0 or args.settle < 0:
        raise UserError("--minutes, --generation-instances and --locust-users must be positive, "
                        "--cancel-clients and --settle not negative")
    cores = cpus_arg(args.cpus)
    genai_perf = find_genai_perf(args.genai_perf)      # fails here, before any server starts
    engine = bench_engine(args.engine, Path("work/bench"), _say)
    results = [soak_one(s, args, engine, genai_perf, cores) for s in strategies]
    command = f"triton-disagg bench soak --minutes {args.minutes:g} --strategies " \
              f"{','.join(strategies)}" + (" --overlap" if args.overlap else "")
    body = markdown(results, args.minutes, command)
    section, title = (("soak-overlap", "Soak: serve all with --overlap_kv_transfer")
                      if args.overlap else ("soak", "Soak: serve all under mixed load"))
    publish(body, args.output, section, title, _say)
    failed = [r.strategy for r in results if r.failures()]
    _say(f"FAIL: {', '.join(failed)}" if failed else "PASS")
    return 1 if failed else 0


def soak_one(strategy: str, args: argparse.Namespace, engine: Path, genai_perf, cores):
    from triton_disagg.bench import soak_clients as clients
    from triton_disagg.bench.soak_report import StrategyResult
    from triton_disagg.bench.soak_server import config_for, scan_logs, serving, wait_pools_empty
    from triton_disagg.bench.soak_tools import (GENAI_PERF_RUN_TIMEOUT, LOCUST_STOP_TIMEOUT,
                                                genai_perf_loop, locust_tallies, start_locust)
    from triton_disagg.bench.soak_watch import (ClientThread, RequestLog, RssSampler, Tally,
                                                rss_rows)
    from triton_disagg.front.tokenizer import Tokenizer

    config, placement = config_for(engine, strategy, args.generation_instances, cores,
                                   args.overlap)
    name = strategy + (OVERLAP_SUFFIX if args.overlap else "")
    work = args.work_dir.resolve() / (strategy + ("-overlap" if args.overlap else ""))
    shutil.rmtree(work, ignore_errors=True)
    tokenizer, log, stop = Tokenizer(engine), RequestLog(), threading.Event()
    seconds, notes = args.minutes * 60.0, []
    _say(f"{name}: starting serve all ({placement})")
    with serving(config, work) as server:
        _say(f"{name}: ready in {server.ready_seconds:.0f} s; {args.minutes:g} min of load")
        sampler = RssSampler(server.process.pid)
        sampler.start()
        load_start = time.monotonic()
        stop_at = load_start + seconds
        locust = start_locust(server.http, server.grpc, engine, seconds, args.locust_users,
                              work / "locust")
        gp_tally = Tally()
        threads = [ClientThread("genai-perf", genai_perf_loop, genai_perf, server.grpc, engine,
                                stop_at, work / "genai-perf", gp_tally,
                                lambda m: _say(f"{name}: {m}"))]
        threads += [ClientThread(f"cancel {i}", clients.cancel_client, server.grpc, server.http,
                                 log, stop, i, tokenizer) for i in range(args.cancel_clients)]
        threads.append(ClientThread("bad input", clients.bad_input_client, server.grpc,
                                    server.http, log, stop, 99, tokenizer))
        for t in threads:
            t.start()
        while time.monotonic() < stop_at and server.process.poll() is None:
            time.sleep(1.0)
        load_end = time.monotonic()
        stop.set()
        _say(f"{name}: load over; waiting for the clients to end")
        for t in threads[1:]:
            t.join(timeout=max(0.0, (log.open_deadline() or 0) - time.monotonic()) + 5)
        threads[0].join(timeout=GENAI_PERF_RUN_TIMEOUT + 30)
        client_failures = {t.name: t.failure() for t in threads if t.failure()}
        tool_tallies = locust_tallies(locust, work / "locust", LOCUST_STOP_TIMEOUT + 120)
        drain = time.monotonic() - load_end
        sampler.stop()
        _say(f"{name}: clients done after {drain:.0f} s; waiting for the KV pools to empty")
        pools, settled = wait_pools_empty(server.metrics, args.settle)
        clients.probe(server.grpc, log, tokenizer)
        serve_exit = server.process.poll()
    crashes = scan_logs(server.server_logs(), server.cli_log)
    if serve_exit is not None:
        crashes.server_exits += 1
        crashes.evidence.append(f"serve exited {serve_exit} during the soak ({server.cli_log})")
    if len(pools) < 1 + args.generation_instances:
        notes.append(f"pool gauges for {sorted(pools)} only; expected context and "
                     f"{args.generation_instances} generation instances")
    own = log.tally()
    tallies = {"genai-perf": gp_tally, **dict(sorted(tool_tallies.items())),
               **{k: own[k] for k in clients.KINDS if k in own}}
    half = load_start + (load_end - load_start) / 2
    result = StrategyResult(name, placement, server.ready_seconds, load_end - load_start,
                            drain, tallies, crashes, pools, settled,
                            rss_rows(sampler.samples, half, load_end), load_end - half, notes,
                            client_failures)
    _say(f"{name}: {result.verdict}" + (f" ({'; '.join(result.failures())})"
                                             if result.failures() else ""))
    return result

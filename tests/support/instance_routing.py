"""One ``serve context`` of two instances, a generation server and a scheduler routing the
context pool ``kv_aware`` (static urls, or etcd), and the check that every repeat of a long
prefix is a prefix-cache hit on the context instance that prefilled it (issue 29, item 5;
import as ``import instance_routing``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import servers
from servers import wait_until
from triton_disagg.routing.scrape import by_label, parse_metrics, total

MAX_TOKENS = 4
REPEATS = 6
PREFIX = "Every request of this conversation starts with the same long system prompt. " * 6
COLD = ("Apples are red.", "Seven seas.", "Zebra crossing.", "Quiet night.")
PREFIX_COUNTERS = ("disagg_prefix_cache_queries_total", "disagg_prefix_cache_hits_total",
                   "disagg_prefix_cache_prefilled_total")


def repeats_hit_the_holder(engine: Path, tmp_path: Path, pools: Callable[[int, int], str]
                           ) -> None:
    """Serve with ``pools(context gRPC port, generation gRPC port)``, the config's lines
    placing the pools (the context server runs 2 instances), then ask a prompt and ``REPEATS``
    prompts of its prefix; each repeat's prefix must come from the cache of the instance
    that prefilled the first, only its suffix computed, with the offline engine's text; then
    prompts that share nothing must reach both instances."""
    ctx_grpc, gen_grpc, ctx_metrics, gen_metrics, ctx_front, gen_front = servers.free_ports(6)
    (tmp_path / "disagg_config.yaml").write_text(
        f"model: {{engine: {engine}}}\n" + pools(ctx_grpc, gen_grpc)
        + "kv_cache: {strategy: direct_transfer, max_size: 32MB}\n")

    def command(role: str, grpc: int, *extra: str) -> list[str]:
        return servers.cli_argv(["triton-disagg", "serve", role, "-c", "disagg_config.yaml",
                                 "--host", "127.0.0.1", "--grpc-port", str(grpc), *extra])

    roles = [(command("context", ctx_grpc, "--metrics-port", str(ctx_metrics), "--front-port",
                      str(ctx_front)), tmp_path / "context", None, f"127.0.0.1:{ctx_grpc}",
              f"http://127.0.0.1:{ctx_metrics}"),
             (command("generation", gen_grpc, "--metrics-port", str(gen_metrics), "--front-port",
                      str(gen_front)), tmp_path / "generation", None, f"127.0.0.1:{gen_grpc}",
              f"http://127.0.0.1:{gen_metrics}")]
    http, grpc, front, sched_metrics = servers.free_ports(4)
    scheduler = (command("scheduler", grpc, "--http-port", str(http), "--front-port", str(front),
                         "--metrics-port", str(sched_metrics)),
                 tmp_path / "scheduler", f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}",
                 f"http://127.0.0.1:{sched_metrics}")
    offline = servers.offline_text(engine)

    with servers.serve_commands(roles, cwd=tmp_path) as (context, _), \
            servers.serve_commands([scheduler], cwd=tmp_path) as (sched,):
        def per_instance(name: str) -> dict[str, float]:
            samples = parse_metrics(servers.metrics(context.metrics))
            context_only = {k: v for k, v in samples.get(name, {}).items()
                            if ("role", "context") in k}
            return by_label({name: context_only}, name, "model_instance")

        def events_read() -> float:
            return total(parse_metrics(servers.metrics(sched.metrics)),
                         "disagg_kv_event_batches_total", outcome="received")

        def ask(prompt: str) -> tuple[dict[str, float], dict[str, float]]:
            """Tokens each instance took from its cache and computed for ``prompt``."""
            before = [per_instance(name) for name in PREFIX_COUNTERS]
            assert "".join(servers.grpc_stream(sched.grpc, prompt, MAX_TOKENS)) == \
                offline(prompt, MAX_TOKENS)

            def counted() -> list[dict[str, float]]:
                return [{k: v - old.get(k, 0) for k, v in per_instance(name).items()}
                        for name, old in zip(PREFIX_COUNTERS, before)]

            def settled() -> bool:         # the instance's metrics lag its answer a little
                queries, hits, prefilled = (sum(c.values()) for c in counted())
                return queries > 0 and hits + prefilled >= queries
            wait_until(settled, 10, "the context's prefix-cache counters of the request")
            return counted()[1], counted()[2]

        assert sorted(per_instance("disagg_prefix_cache_prefilled_total")) == \
            ["context_0_0", "context_1_0_0"]         # one model per instance, each reporting
        _, first = ask(PREFIX + "Who are you?")
        (holder,) = [i for i, tokens in first.items() if tokens > 0]
        seen = events_read()      # its stored blocks reach the router's index, then more come
        wait_until(lambda: events_read() >= seen + 4, 10, "the context's KV events read")
        for i in range(REPEATS):
            hit, computed = ask(PREFIX + f"Question number {i}?")
            # the whole prefix came from the holder's cache; only the suffix was computed
            assert hit[holder] >= first[holder] // 2 and sum(computed.values()) < \
                first[holder] // 2, (i, holder, hit, computed, first)
        # prompts that share nothing take turns (equal cost): the router reaches both models
        cold = [ask(prompt)[1] for prompt in COLD]
        assert all(sum(c[instance] for c in cold) > 0 for instance in first), cold

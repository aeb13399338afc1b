"""The kv_aware router's choice reaches the context instance that holds the cache (issue 29,
item 5), with ONE ``serve context`` running two instances: each instance is a Triton model
of its own (``context``, ``context_1``) with its own KV events publisher, so the scheduler
calls the instance it picked. A prompt, then the same long prefix again and again: every
repeat is a prefix-cache hit on the instance that prefilled it (the context's
``disagg_prefix_cache_*`` counters, per model instance), with the offline engine's text;
with one model of two instances Triton chose the instance and about half missed."""

from __future__ import annotations

import servers
from servers import wait_until
from triton_disagg.routing.scrape import by_label, parse_metrics, total

MAX_TOKENS = 4
REPEATS = 6
PREFIX = "Every request of this conversation starts with the same long system prompt. " * 6


def test_repeats_of_a_prefix_hit_the_instance_that_holds_it(demo_engine, tmp_path):
    ctx_grpc, gen_grpc, ctx_metrics, gen_metrics, ctx_front, gen_front = servers.free_ports(6)
    kv_events_port = servers.free_port_run(2)          # one publisher port per instance
    (tmp_path / "disagg_config.yaml").write_text(
        f"model: {{engine: {demo_engine}}}\n"
        f"context_server: {{urls: [\"127.0.0.1:{ctx_grpc}\"], instances: 2, router: kv_aware, "
        f"kv_events_port: {kv_events_port}}}\n"
        f"generation_server: {{urls: [\"127.0.0.1:{gen_grpc}\"], instances: 1}}\n"
        "kv_cache: {strategy: direct_transfer, max_size: 32MB}\n")

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
    offline = servers.offline_text(demo_engine)

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

        def ask(suffix: str) -> tuple[dict[str, float], dict[str, float]]:
            """Tokens each instance took from its cache and computed for the prompt."""
            names = ("disagg_prefix_cache_queries_total", "disagg_prefix_cache_hits_total",
                     "disagg_prefix_cache_prefilled_total")
            before = [per_instance(name) for name in names]
            prompt = PREFIX + suffix
            assert "".join(servers.grpc_stream(sched.grpc, prompt, MAX_TOKENS)) == \
                offline(prompt, MAX_TOKENS)

            def counted() -> list[dict[str, float]]:
                return [{k: v - old.get(k, 0) for k, v in per_instance(name).items()}
                        for name, old in zip(names, before)]

            def settled() -> bool:         # the instance's metrics lag its answer a little
                queries, hits, prefilled = (sum(c.values()) for c in counted())
                return queries > 0 and hits + prefilled >= queries
            wait_until(settled, 10, "the context's prefix-cache counters of the request")
            return counted()[1], counted()[2]

        assert sorted(per_instance("disagg_prefix_cache_prefilled_total")) == \
            ["context_0_0", "context_1_0_0"]         # one model per instance, each reporting
        _, first = ask("Who are you?")
        (holder,) = [i for i, tokens in first.items() if tokens > 0]
        seen = events_read()      # its stored blocks reach the router's index, then more come
        wait_until(lambda: events_read() >= seen + 4, 10, "the context's KV events read")
        for i in range(REPEATS):
            hit, computed = ask(f"Question number {i}?")
            # the whole prefix came from the holder's cache; only the suffix was computed
            assert hit[holder] >= first[holder] // 2 and sum(computed.values()) < \
                first[holder] // 2, (i, holder, hit, computed, first)


def test_serve_all_spreads_its_context_calls_over_the_instance_models(demo_engine, tmp_path):
    """``serve all`` (BLS, no router) takes its context instances' models in turn, as Triton
    spread calls over one model's instances, each request's text the offline engine's."""
    config = (f"model: {{engine: {demo_engine}}}\n"
              "context_server: {instances: 2}\ngeneration_server: {instances: 1}\n"
              "kv_cache: {max_size: 32MB}\n")
    offline = servers.offline_text(demo_engine)
    with servers.serve_config(config, tmp_path) as served:
        for prompt in servers.PROMPTS:
            assert "".join(servers.grpc_stream(served.grpc, prompt, MAX_TOKENS)) == \
                offline(prompt, MAX_TOKENS)
        samples = parse_metrics(servers.metrics(served.metrics))
        calls = {model: total(samples, "nv_inference_request_success", model=model)
                 for model in ("context", "context_1")}
        assert calls == {"context": 2, "context_1": 2}, calls

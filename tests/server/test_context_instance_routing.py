"""The kv_aware router's choice reaches the context instance that holds the cache (issue 29,
item 5), with ONE ``serve context`` running two instances over static urls: each instance is
a Triton model of its own (``context``, ``context_1``) with its own KV events publisher
(``kv_events_port``), so the scheduler calls the instance it picked. A prompt, then the
same long prefix again and again: every repeat is a prefix-cache hit on the instance that
prefilled it (the context's ``disagg_prefix_cache_*`` counters, per model instance:
:mod:`instance_routing`); with one model of two instances Triton chose the instance and
about half missed. ``serve all`` (no router) takes its instances' models in turn."""

from __future__ import annotations

import instance_routing
import servers
from instance_routing import MAX_TOKENS
from triton_disagg.routing.scrape import parse_metrics, total


def test_repeats_of_a_prefix_hit_the_instance_that_holds_it(demo_engine, tmp_path):
    kv_events_port = servers.free_port_run(2)          # one publisher port per instance
    instance_routing.repeats_hit_the_holder(demo_engine, tmp_path, lambda ctx, gen: (
        f"context_server: {{urls: [\"127.0.0.1:{ctx}\"], instances: 2, router: kv_aware, "
        f"kv_events_port: {kv_events_port}}}\n"
        f"generation_server: {{urls: [\"127.0.0.1:{gen}\"], instances: 1}}\n"))


def test_serve_all_spreads_its_context_calls_over_the_instance_models(demo_engine, tmp_path):
    """``serve all`` (BLS, no router) takes its context instances' models in turn, as Triton
    spread calls over one model's instances, each request's text the offline engine's."""
    config = (f"model: {{engine: {demo_engine}}}\n"
              "context_server: {instances: 2}\ngeneration_server: {instances: 1}\n"
              "kv_cache: {max_size: 32MB}\n")
    offline = servers.offline_text(demo_engine)
    with servers.serve_config(config, tmp_path) as served:
        for prompt in servers.PROMPTS:
            text = "".join(servers.grpc_stream(served.grpc, prompt, MAX_TOKENS))
            assert text == offline(prompt, MAX_TOKENS)
        samples = parse_metrics(servers.metrics(served.metrics))
        calls = {model: total(samples, "nv_inference_request_success", model=model)
                 for model in ("context", "context_1")}
        assert calls == {"context": 2, "context_1": 2}, calls

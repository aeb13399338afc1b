"""KV grown on demand on a real `serve all` (disaggregated, ``direct_transfer``): a
generation pool of 15 blocks holds two of these requests' whole ``prompt + max_tokens`` but
not four, so with ``MAX_UTILIZATION`` (the default) all four start, the newest are
preempted and recomputed on the generation server, and every streamed text (deltas
concatenated) equals the offline text, each token once; ``disagg_preemptions_total`` counts
them and every block is free at the end."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import servers
from triton_disagg.routing.scrape import scrape, total
from waiting import wait_until

REQUESTS = 4
MAX_TOKENS = 100
MAX_SEQ_LEN = 128    # so that a pool of 1 MB (15 KV blocks of 16 tokens) is allowed
PROMPTS = [f"Request {i} asks for a long story:" for i in range(REQUESTS)]   # 12 tokens


@pytest.fixture(scope="module")
def short_engine(demo_checkpoint, tmp_path_factory):
    from triton_disagg.builders.build import build_engine

    path = tmp_path_factory.mktemp("short") / "engine"
    build_engine(demo_checkpoint, path, max_seq_len=MAX_SEQ_LEN)
    return path


def test_preempted_streams_finish_with_the_offline_text_and_free_every_block(short_engine,
                                                                             tmp_path):
    offline = servers.offline_text(short_engine)
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {short_engine}, runtime: numpy, device: cpu}}\n"
                      f"kv_cache: {{strategy: direct_transfer, max_size: 1MB}}\n")
    with servers.serve("all", ["-c", str(config)], tmp_path / "run") as served:
        with ThreadPoolExecutor(REQUESTS) as pool:
            streams = list(pool.map(lambda p: servers.grpc_stream(
                served.grpc, p, MAX_TOKENS), PROMPTS))
        for prompt, deltas in zip(PROMPTS, streams):
            assert "".join(deltas) == offline(prompt, MAX_TOKENS)

        def at_rest() -> bool:
            used = scrape(served.metrics).get("disagg_kv_blocks_used", {})
            return len(used) == 2 and not any(used.values())

        wait_until(at_rest, 10, "0 KV blocks used on both roles")
        wait_until(lambda: total(scrape(served.metrics), "disagg_preemptions_total",
                                 role="generation") >= 1, 10, "a preemption counted")

"""``serve generation`` with ``discovery`` in the config, on a real tritonserver and a real
etcd: once ready it is registered with its engine, capacity and load (read from its
metrics endpoint), and after a clean stop its key is already gone."""

from __future__ import annotations

import time

import etcd_server
import serving
from etcd_server import wait_until
from triton_disagg.bench.serve_metrics import scrape, total
from triton_disagg.discovery import Membership
from triton_disagg.engine.spec import EngineSpec


def test_serve_registers_and_deregisters(demo_engine, tmp_path):
    etcd = etcd_server.EtcdServer(tmp_path / "etcd-data").start()
    fingerprint = EngineSpec.load(demo_engine).fingerprint
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\nkv_cache: {{max_size: 64MiB}}\n"
                      f"discovery: {{etcd: '{etcd.endpoint}', prefix: /it, ttl_seconds: 3}}\n")
    membership = Membership(etcd.discovery("/it", 3), fingerprint).start()
    try:
        with serving.serve("generation", ["-c", str(config)], tmp_path / "gen", http=False) as gen:
            # Registered before "ready" was printed; seen at the scheduler's next poll.
            wait_until(lambda: membership.members("generation"), 2.0, "registered when ready")
            member = membership.members("generation")[0]
            assert member.grpc_url == gen.grpc and member.fingerprint == fingerprint
            assert f"etcd     /it/generation/{gen.grpc} on {etcd.endpoint}" in gen.log.read_text()
            assert member.tokens_per_block == EngineSpec.load(demo_engine).kv.tokens_per_block
            # The load: free blocks from the pool gauges, once the model reported them.
            wait_until(lambda: membership.members("generation")[0].load.free_kv_blocks
                       is not None, 5.0, "load published")
            blocks = total(scrape(gen.metrics), "disagg_kv_blocks_total", role="generation")
            assert member.kv_blocks_total == blocks > 0    # the pool the server really has
            assert membership.members("generation")[0].load.free_kv_blocks == blocks   # idle
            stopped = serving.stop(gen)
        assert stopped == 0
        time.sleep(2 * membership.poll_seconds)        # two polls after serve exited
        assert membership.members("generation") == ()  # deregistered, not left to lapse
    finally:
        membership.close()
        etcd.stop()

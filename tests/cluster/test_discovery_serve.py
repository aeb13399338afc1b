"""``serve generation`` with ``discovery`` in the config, on a real tritonserver and a real
etcd: once ready it is registered at its advertised address with its engine, capacity and
load (free KV blocks and live sequences, read from its metrics endpoint), and after a
clean stop its key is already gone. Mistakes about the advertised address are one line before anything starts."""

from __future__ import annotations

import pytest

import etcd_server
import servers
from servers import wait_until
from triton_disagg.routing.scrape import scrape, total
from triton_disagg.cli import main
from triton_disagg.routing.discovery import Membership
from triton_disagg.engine.spec import EngineSpec


def test_serve_registers_and_deregisters(demo_engine, tmp_path):
    etcd = etcd_server.EtcdServer(tmp_path / "etcd-data").start()
    fingerprint = EngineSpec.load(demo_engine).fingerprint
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\nkv_cache: {{max_size: 64MiB}}\n"
                      f"discovery: {{etcd: '{etcd.endpoint}', prefix: /it, ttl_seconds: 3}}\n")
    membership = Membership(etcd.discovery("/it", 3), fingerprint).start()
    try:
        args = ["-c", str(config), "--advertise", "gen-01.example:8001"]
        with servers.serve("generation", args, tmp_path / "gen", http=False) as gen:
            # Registered before "ready" was printed; seen at the scheduler's next poll.
            wait_until(lambda: membership.members("generation"), 2.0, "registered when ready")
            member = membership.members("generation")[0]
            assert member.grpc_url == "gen-01.example:8001" and member.fingerprint == fingerprint
            assert (f"etcd     /it/generation/gen-01.example:8001 on {etcd.endpoint}"
                    in gen.log.read_text())
            assert member.tokens_per_block == EngineSpec.load(demo_engine).kv.tokens_per_block
            # The load: free blocks from the pool gauges, once the model reported them.
            wait_until(lambda: membership.members("generation")[0].load.free_kv_blocks
                       is not None, 5.0, "load published")
            blocks = total(scrape(gen.metrics), "disagg_kv_blocks_total", role="generation")
            assert member.kv_blocks_total == blocks > 0    # the pool the server really has
            wait_until(lambda: membership.members("generation")[0].load.live_sequences
                       is not None, 5.0, "live sequences published")
            load = membership.members("generation")[0].load
            assert (load.free_kv_blocks, load.live_sequences) == (blocks, 0)      # idle
            assert load.queued_prompt_tokens is None        # a context server's figure
            stopped = servers.stop(gen)
        assert stopped == 0
        wait_until(lambda: membership.members("generation") == (), 2 * membership.poll_seconds,
                   "deregistered within two polls, not left to lapse (a 3 s lease)")
    finally:
        membership.close()
        etcd.stop()


@pytest.mark.parametrize("role, discovery, flags, words", [
    ("generation", True, ["--host", "0.0.0.0"], ["--advertise", "0.0.0.0", "HOST:PORT"]),
    ("context", True, ["--advertise", "nohostport"], ["--advertise", "'nohostport'", "host:port"]),
    ("all", False, ["--advertise", "gen-01:8001"], ["--advertise", "serve all advertises nothing"]),
    ("scheduler", False, [], ["context_server.url", "missing", "urls", "discovery"]),
])
def test_advertise_mistakes_are_one_line(demo_engine, tmp_path, capsys, role, discovery, flags,
                                         words):
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\n"
                      + ("discovery: {etcd: '127.0.0.1:1'}\n" if discovery else ""))
    code = main(["serve", role, "-c", str(config), "--grpc-port", "9101",
                 "--work-dir", str(tmp_path / "w"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err, err
    assert not (tmp_path / "w").exists()          # refused before anything started


def test_advertised_by_default_is_the_bound_address(demo_engine, tmp_path):
    from triton_disagg.config.disagg import load_config
    from triton_disagg.launch.deploy import PortFlags, advertised_url
    from triton_disagg.triton.endpoints import Endpoints

    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\ndiscovery: {{etcd: '127.0.0.1:1'}}\n")
    bound = Endpoints(host="10.0.0.7", http_port=None, grpc_port=9101, metrics_port=None)
    assert advertised_url("generation", load_config(config), bound, PortFlags()) == "10.0.0.7:9101"
    assert advertised_url("all", load_config(config), bound, PortFlags()) is None  # only the roles

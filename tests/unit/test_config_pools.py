"""Pools in disagg_config.yaml: ``urls: [...]`` and ``discovery: {etcd, prefix,
ttl_seconds}`` load, and so do the routing keys (``router`` per role,
``generation_server.max_local_prefill_length``); each mistake is one line naming the key
and the fix; configs without them load as before."""

from __future__ import annotations

import pytest

from config_files import assert_one_line_error, config_writer
from triton_disagg.config.disagg import load_config
from triton_disagg.config.discovery_section import DiscoveryConfig

ENGINE = "model: {engine: engines/demo}\n"


@pytest.fixture
def write(tmp_path):
    return config_writer(tmp_path, ENGINE)


def test_static_pool(write):
    cfg = load_config(write("context_server: {urls: ['ctx-01:8001', 'grpc://ctx-02:8001']}\n"
                            "generation_server: {url: 'gen-01:8001'}\n"))
    assert cfg.context.urls == ("ctx-01:8001", "ctx-02:8001") and cfg.context.url is None
    assert cfg.generation.urls == ("gen-01:8001",) and cfg.generation.url == "gen-01:8001"
    assert cfg.discovery is None


def test_one_entry_pool_is_url(write):
    cfg = load_config(write("context_server: {urls: ['ctx-01:9001']}\n"))
    assert cfg.context.url == "ctx-01:9001" and cfg.context.port == 9001


def test_without_pools_nothing_changes(write):
    cfg = load_config(write(""))
    assert cfg.context.urls == () and cfg.context.url is None and cfg.discovery is None


def test_routing_keys_and_their_defaults(write):
    cfg = load_config(write(""))
    assert cfg.context.router == cfg.generation.router == "least_loaded"
    assert cfg.generation.max_local_prefill_length == 0             # off
    cfg = load_config(write("context_server: {urls: ['a:1', 'b:1'], router: round_robin}\n"
                            "generation_server: {url: 'g:1', router: least_loaded, "
                            "max_local_prefill_length: 64}\n"))
    assert (cfg.context.router, cfg.generation.router) == ("round_robin", "least_loaded")
    assert cfg.generation.max_local_prefill_length == 64
    cfg = load_config(write("context_server: {url: 'c:1', router: kv_aware}\n"
                            "generation_server: {url: 'g:1', router: kv_aware}\n"))
    assert cfg.context.router == cfg.generation.router == "kv_aware"
    cfg = load_config(write("context_server: {urls: ['c:1'], router: kv_aware, "
                            "kv_events_port: 5557, instances: 2}\n"))
    assert (cfg.context.kv_events_port, cfg.context.instances) == (5557, 2)
    assert cfg.generation.kv_events_port is None                  # a free port each


@pytest.mark.parametrize("value, words", [
    ("'5557'", ["context_server.kv_events_port", "port number"]),
    ("0", ["context_server.kv_events_port", "port number"]),
    ("65535", ["context_server.kv_events_port", "65535", "lower"]),   # 2 instances
])
def test_kv_events_port_mistakes_are_one_line(write, value, words):
    assert_one_line_error(write(f"context_server: {{url: 'c:1', instances: 2, "
                                f"kv_events_port: {value}}}\n"), words)


def test_discovery(write):
    cfg = load_config(write("discovery: {etcd: 'http://etcd-01:2379', prefix: /triton-disagg/demo/, "
                            "ttl_seconds: 3}\ngeneration_server: {url: 'gen-01:8001'}\n"))
    assert cfg.discovery == DiscoveryConfig(etcd="etcd-01:2379", prefix="/triton-disagg/demo",
                                            ttl_seconds=3)
    assert cfg.discovery.etcd_host == "etcd-01" and cfg.discovery.etcd_port == 2379
    assert cfg.generation.url == "gen-01:8001"      # where that one server binds


def test_discovery_defaults(write):
    assert load_config(write("discovery: {etcd: '127.0.0.1:2379'}\n")).discovery == \
        DiscoveryConfig(etcd="127.0.0.1:2379", prefix="/triton-disagg", ttl_seconds=10)


@pytest.mark.parametrize("text, words", [
    ("context_server: {url: 'a:1', urls: ['b:1']}\n", ["context_server", "url", "urls", "not both"]),
    ("context_server: {urls: []}\n", ["context_server.urls", "non-empty list"]),
    ("context_server: {urls: 'a:1'}\n", ["context_server.urls", "list of host:port"]),
    ("generation_server: {urls: ['a:1', 'nohostport']}\n", ["generation_server.urls",
                                                            "'nohostport'", "host:port"]),
    ("generation_server: {urls: ['a:1', 'a:1']}\n", ["generation_server.urls", "twice"]),
    ("scheduler_server: {urls: ['a:1']}\n", ["scheduler_server", "'urls'", "allowed keys"]),
    ("discovery: {prefix: /x}\n", ["discovery.etcd", "missing", "127.0.0.1:2379"]),
    ("discovery: {etcd: etcd-01}\n", ["discovery.etcd", "host:port"]),
    ("discovery: {etcd: 'e:2379', prefix: x}\n", ["discovery.prefix", "starting with /"]),
    ("discovery: {etcd: 'e:2379', prefix: /}\n", ["discovery.prefix", "starting with /"]),
    ("discovery: {etcd: 'e:2379', ttl_seconds: 1}\n", ["discovery.ttl_seconds", ">= 2"]),
    ("discovery: {etcd: 'e:2379', ttl_seconds: 2.5}\n", ["discovery.ttl_seconds", "whole number"]),
    ("discovery: {etcd: 'e:2379', ttl: 5}\n", ["discovery", "'ttl'", "ttl_seconds"]),
    ("discovery: etcd-01:2379\n", ["discovery", "mapping"]),
    ("discovery: {etcd: 'e:2379'}\ncontext_server: {urls: ['a:1', 'b:1']}\n",
     ["context_server.urls", "discovery", "drop"]),
    ("context_server: {router: random}\n", ["context_server.router", "'random'",
                                            "least_loaded, round_robin"]),
    ("generation_server: {router: [round_robin]}\n", ["generation_server.router", "one of"]),
    ("generation_server: {max_local_prefill_length: -1}\n",
     ["generation_server.max_local_prefill_length", ">= 0", "0: every prompt"]),
    ("generation_server: {max_local_prefill_length: 1.5}\n",
     ["generation_server.max_local_prefill_length", "whole number"]),
    ("context_server: {max_local_prefill_length: 8}\n",
     ["context_server", "'max_local_prefill_length'", "allowed keys"]),
    ("scheduler_server: {router: round_robin}\n", ["scheduler_server", "'router'"]),
])
def test_mistakes_are_one_line_naming_the_key(write, text, words):
    assert_one_line_error(write(text), words)

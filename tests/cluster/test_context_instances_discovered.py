"""The kv_aware router's choice reaches the context instance that holds the cache with the
servers found in etcd (issue 29, item 5): ``serve context`` of two instances registers one
record naming both of its models (``context``, ``context_1``), each with its instance's KV
events publisher and load; the scheduler expands it into a member per instance, and every
repeat of a long prefix is a cache hit on the instance that prefilled it
(:mod:`instance_routing`)."""

from __future__ import annotations

import etcd_server
import instance_routing


def test_a_registered_server_of_two_instances_is_routed_per_instance(demo_engine, tmp_path):
    etcd = etcd_server.EtcdServer(tmp_path / "etcd-data").start()
    try:
        instance_routing.repeats_hit_the_holder(demo_engine, tmp_path, lambda ctx, gen: (
            "context_server: {instances: 2, router: kv_aware}\n"
            "generation_server: {instances: 1}\n"
            f"discovery: {{etcd: '{etcd.endpoint}', prefix: /instances, ttl_seconds: 3}}\n"))
    finally:
        etcd.stop()

"""A server's registration in a process of its own, for tests that SIGKILL it.

``python discovery_member.py ETCD PREFIX TTL ROLE GRPC_URL FINGERPRINT`` registers,
prints ``registered`` and keeps heartbeating until it is killed.
"""

from __future__ import annotations

import sys
import threading

from triton_disagg.config.discovery_section import DiscoveryConfig
from triton_disagg.routing.discovery import MemberRecord, Registration

if __name__ == "__main__":
    etcd, prefix, ttl, role, url, fingerprint = sys.argv[1:]
    registration = Registration(
        DiscoveryConfig(etcd=etcd, prefix=prefix, ttl_seconds=int(ttl)),
        MemberRecord(role=role, grpc_url=url, fingerprint=fingerprint, kv_blocks_total=64,
                     tokens_per_block=16)).start()
    print("registered" if registration.registered else "etcd does not answer", flush=True)
    threading.Event().wait()

"""etcd membership against a real etcd (tests/support/etcd_server.py; no mocks): a server that
registers is seen within 2 s, one that dies is dropped once its lease lapses, one that
closes is dropped at once; with etcd killed the scheduler keeps the last set and says so,
and when etcd comes back (same data dir, or its data lost) the registrations come back;
a server with another engine fingerprint is refused, loudly and once; over TLS with client
certificates and user/password auth, members register and are seen, strangers are refused;
a role with more records than a poll reads is read up to the limit, the rest counted."""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

import etcd_server
from servers import wait_until
from triton_disagg.config.discovery_section import DiscoveryConfig
from triton_disagg.routing.discovery import (Load, Loads, MemberRecord, Membership, Registration,
                                             membership as membership_module)
from triton_disagg.routing.discovery.etcd import ETCD_ERRORS, connect

MEMBER = Path(__file__).resolve().parents[1] / "support" / "discovery_member.py"   # a registrant
TTL = 2                              # seconds: etcd's shortest whole-second lease
OURS, THEIRS = "a" * 64, "b" * 64    # engine fingerprints
JOIN_BOUND = 2.0                     # the bound: a server that joins gets traffic within 2 s


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """One etcd for the tests that do not stop it (each test uses its own prefix)."""
    server = etcd_server.EtcdServer(tmp_path_factory.mktemp("etcd") / "data").start()
    yield server
    server.stop()


@pytest.fixture
def own_etcd(tmp_path):
    """An etcd this test may kill and restart."""
    server = etcd_server.EtcdServer(tmp_path / "etcd-data").start()
    yield server
    server.stop()


@pytest.fixture
def prefix(request) -> str:
    return f"/test/{request.node.name}"


def record(url: str, role: str = "generation", fingerprint: str = OURS) -> MemberRecord:
    return MemberRecord(role=role, grpc_url=url, fingerprint=fingerprint, kv_blocks_total=64,
                        tokens_per_block=16)


def urls(membership: Membership, role: str = "generation") -> list[str]:
    return [m.grpc_url for m in membership.members(role)]


def test_join_is_seen_within_2s_with_its_record_and_load(etcd, prefix):
    discovery = etcd.discovery(prefix, TTL)
    loads = iter(range(64, 0, -1))        # free blocks of its 64, fewer at each beat
    membership = Membership(discovery, OURS).start()
    try:
        assert membership.etcd_reachable and urls(membership) == []
        registration = Registration(discovery, record("gen-01:8001"),
                                    load=lambda: Loads(Load(free_kv_blocks=next(loads)))).start()
        joined = wait_until(lambda: urls(membership) == ["gen-01:8001"], JOIN_BOUND, "join seen")
        seen = membership.members("generation")[0]
        assert (seen.fingerprint, seen.kv_blocks_total, seen.tokens_per_block) == (OURS, 64, 16)
        assert membership.members("context") == ()
        # The load is republished about once a second: a newer figure arrives.
        first = seen.load.free_kv_blocks
        wait_until(lambda: membership.members("generation")[0].load.free_kv_blocks < first,
                   2.5, "a newer load published")
        print(f"join seen after {joined * 1000:.0f} ms")
        registration.close()
    finally:
        membership.close()


def test_clean_close_drops_at_once(etcd, prefix):
    discovery = etcd.discovery(prefix, TTL)
    membership = Membership(discovery, OURS).start()
    try:
        registration = Registration(discovery, record("ctx-01:8001", role="context")).start()
        wait_until(lambda: urls(membership, "context") == ["ctx-01:8001"], JOIN_BOUND, "join")
        registration.close()
        gone = wait_until(lambda: urls(membership, "context") == [], 0.75, "gone after close")
        print(f"closed registration gone after {gone * 1000:.0f} ms")
        assert not registration.registered
    finally:
        membership.close()


def test_killed_server_is_dropped_when_its_lease_lapses(etcd, prefix):
    membership = Membership(etcd.discovery(prefix, TTL), OURS).start()
    member = subprocess.Popen(
        [sys.executable, str(MEMBER), etcd.endpoint,
         prefix, str(TTL), "generation", "gen-02:8001", OURS],
        stdout=subprocess.PIPE, text=True)
    try:
        assert member.stdout.readline().strip() == "registered"
        wait_until(lambda: urls(membership) == ["gen-02:8001"], JOIN_BOUND, "join")
        member.send_signal(signal.SIGKILL)
        member.wait()
        # The lease lapses TTL after the last heartbeat; etcd sweeps lapsed leases every
        # 0.5 s and the scheduler polls every 0.25 s.
        lapsed = wait_until(lambda: urls(membership) == [], TTL + 0.5 + 2 * membership.poll_seconds,
                            "dropped after the lease")
        print(f"SIGKILLed member dropped after {lapsed:.2f} s (ttl {TTL} s)")
        # Dropped by the lease, not at once: the heartbeat was at most a beat old.
        assert lapsed > TTL - 1.0
    finally:
        member.kill()
        member.wait()
        membership.close()


def test_another_engine_is_refused_loudly_once(etcd, prefix, caplog):
    discovery = etcd.discovery(prefix, TTL)
    membership = Membership(discovery, OURS).start()
    theirs = Registration(discovery, record("gen-09:8001", fingerprint=THEIRS)).start()
    ours = Registration(discovery, record("gen-03:8001")).start()
    try:
        with caplog.at_level(logging.WARNING, logger="triton_disagg.routing.discovery"):
            wait_until(lambda: urls(membership) == ["gen-03:8001"], JOIN_BOUND, "ours seen")
            time.sleep(4 * membership.poll_seconds)       # several more polls see theirs
        refusals = [r for r in caplog.records if "REFUSED" in r.getMessage()]
        assert len(refusals) == 1 and refusals[0].levelno == logging.ERROR
        assert "gen-09:8001" in refusals[0].getMessage() and THEIRS[:16] in refusals[0].getMessage()
        assert urls(membership) == ["gen-03:8001"]
    finally:
        ours.close()
        theirs.close()
        membership.close()


def test_a_poll_reads_at_most_the_limit_per_role_from_a_real_etcd(etcd, prefix, monkeypatch):
    """etcd's own range limit and count (through its JSON gateway): with the limit at 3,
    5 generation records are read as their first 3 in key order, 2 counted unread."""
    monkeypatch.setattr(membership_module, "MEMBERS_PER_ROLE", 3)
    discovery = etcd.discovery(prefix, TTL)
    client = connect(discovery, timeout=2)
    for i in range(5):
        client.put(f"{prefix}/generation/gen-{i}:8001", record(f"gen-{i}:8001").to_json())
    client.put(f"{prefix}/context/ctx-0:8001", record("ctx-0:8001", role="context").to_json())
    membership = Membership(discovery, OURS).start()
    try:
        assert urls(membership) == ["gen-0:8001", "gen-1:8001", "gen-2:8001"]
        assert urls(membership, "context") == ["ctx-0:8001"]
        assert membership.unread == {"context": 0, "generation": 2}
    finally:
        membership.close()


def test_etcd_killed_keeps_the_last_set_then_restarted_clears_the_flag(own_etcd, prefix, caplog):
    discovery = own_etcd.discovery(prefix, TTL)
    membership = Membership(discovery, OURS).start()
    registration = Registration(discovery, record("gen-04:8001")).start()
    try:
        with caplog.at_level(logging.WARNING, logger="triton_disagg.routing.discovery"):
            wait_until(lambda: urls(membership) == ["gen-04:8001"], JOIN_BOUND, "join")
            own_etcd.kill()
            down = wait_until(lambda: not membership.etcd_reachable, 1.0, "etcd seen down")
            wait_until(lambda: not registration.registered, 2.0, "registration sees etcd down")
            # Down longer than a lease: the last known set stays.
            time.sleep(TTL + 0.5)
            assert urls(membership) == ["gen-04:8001"] and not membership.etcd_reachable
            own_etcd.start()
            back = wait_until(lambda: membership.etcd_reachable and registration.registered,
                              3.0, "etcd seen back")
            assert urls(membership) == ["gen-04:8001"]
            time.sleep(TTL + 0.5)     # the same lease keeps being refreshed: it stays
            assert urls(membership) == ["gen-04:8001"]
        lines = [r.getMessage() for r in caplog.records if r.name.endswith(".membership")]
        assert sum("does not answer" in m for m in lines) == 1, lines
        assert sum("answers again" in m for m in lines) == 1, lines
        print(f"etcd down seen after {down * 1000:.0f} ms, back after {back * 1000:.0f} ms")
    finally:
        registration.close()
        membership.close()


def test_registration_comes_back_when_etcd_lost_its_data(own_etcd, prefix):
    discovery = own_etcd.discovery(prefix, TTL)
    membership = Membership(discovery, OURS).start()
    registration = Registration(discovery, record("gen-05:8001")).start()
    try:
        wait_until(lambda: urls(membership) == ["gen-05:8001"], JOIN_BOUND, "join")
        own_etcd.kill()
        wait_until(lambda: not registration.registered, 2.0, "registration sees etcd down")
        shutil.rmtree(own_etcd.data_dir)            # its lease is gone with the data
        own_etcd.start()
        back = wait_until(lambda: urls(membership) == ["gen-05:8001"] and registration.registered,
                          3.0, "registered again on the new etcd")
        print(f"re-registered {back * 1000:.0f} ms after etcd came back empty")
    finally:
        registration.close()
        membership.close()


def test_etcd_absent_at_start(tmp_path, prefix, caplog):
    """A scheduler or server started before etcd says so and catches up once it runs."""
    server = etcd_server.EtcdServer(tmp_path / "etcd-data")
    discovery = server.discovery(prefix, TTL)
    with caplog.at_level(logging.WARNING, logger="triton_disagg.routing.discovery"):
        membership = Membership(discovery, OURS).start()
        registration = Registration(discovery, record("gen-06:8001")).start()
    try:
        assert not membership.etcd_reachable and not registration.registered
        assert sum("does not answer" in r.getMessage() for r in caplog.records) == 2
        server.start()
        wait_until(lambda: urls(membership) == ["gen-06:8001"], 3.0, "seen once etcd runs")
    finally:
        registration.close()
        membership.close()
        server.stop()


def _tls_files(folder: Path) -> dict[str, Path]:
    """A CA, etcd's server certificate (for 127.0.0.1) and a client certificate, made with
    the openssl CLI. The client's has no CommonName: with auth on, etcd's JSON gateway
    refuses a client certificate that has one."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "2", "-subj", "/CN=test-ca")
    (folder / "usage.ext").write_text("subjectAltName=IP:127.0.0.1\n"
                                      "extendedKeyUsage=serverAuth,clientAuth\n")
    for who, subject in (("server", "/CN=127.0.0.1"), ("client", "/O=triton-disagg")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out",
            f"{who}.csr", "-subj", subject)
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{who}.crt", "-days", "2", "-extfile", "usage.ext")
    return {name: folder / name for name in ("ca.crt", "server.crt", "server.key",
                                             "client.crt", "client.key")}


def test_tls_and_auth_etcd_serves_members_and_refuses_strangers(tmp_path, prefix, monkeypatch):
    """etcd over https with client certificates and user/password auth: a registration and
    a membership configured with discovery's ca_file/cert_file/key_file/username/password_env
    see each other (through AuthClient's token, renewed after a bogus one); a client without
    the password, or without TLS, gets nothing."""
    files = _tls_files(tmp_path)
    client_port, peer_port = etcd_server.free_ports(2)
    url, peer = f"https://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    server = subprocess.Popen(
        [etcd_server.etcd_binary(), "--name", "t", "--data-dir", str(tmp_path / "data"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"t={peer}", "--cert-file", str(files["server.crt"]),
         "--key-file", str(files["server.key"]), "--trusted-ca-file", str(files["ca.crt"]),
         "--client-cert-auth"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    monkeypatch.setenv("ETCD_TEST_PASSWORD", "s3cret")
    tls = DiscoveryConfig(etcd=f"127.0.0.1:{client_port}", prefix=prefix, ttl_seconds=TTL,
                          ca_file=str(files["ca.crt"]), cert_file=str(files["client.crt"]),
                          key_file=str(files["client.key"]))
    secured = replace(tls, username="root", password_env="ETCD_TEST_PASSWORD")
    try:
        admin = connect(tls, timeout=2)
        wait_until(lambda: _answers(admin), 15, "etcd over TLS answers")
        for path, body in (("/auth/role/add", {"name": "root"}),
                           ("/auth/user/add", {"name": "root", "password": "s3cret"}),
                           ("/auth/user/grant", {"user": "root", "role": "root"}),
                           ("/auth/enable", {})):
            admin.post(admin.get_url(path), json=body)
        membership = Membership(secured, OURS).start()
        registration = Registration(secured, record("gen-tls:8001")).start()
        try:
            wait_until(lambda: urls(membership) == ["gen-tls:8001"], JOIN_BOUND, "join over TLS")
            assert registration.registered and membership.etcd_reachable
            membership._client.session.headers["Authorization"] = "bogus"   # as after a restart
            time.sleep(4 * membership.poll_seconds)
            assert membership.etcd_reachable and urls(membership) == ["gen-tls:8001"]
        finally:
            registration.close()
            membership.close()
        monkeypatch.setenv("ETCD_TEST_PASSWORD", "wrong")
        for stranger in (tls, secured, replace(secured, ca_file=None, cert_file=None,
                                               key_file=None)):
            with pytest.raises(ETCD_ERRORS):
                connect(stranger, timeout=2).get_prefix(prefix + "/")
    finally:
        server.terminate()
        server.wait(timeout=10)


def _answers(client) -> bool:
    try:
        client.status()
        return True
    except ETCD_ERRORS:
        return False

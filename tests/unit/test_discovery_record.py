"""The member record's JSON and the load read from a metrics endpoint (no etcd needed);
against a fake etcd client (etcd3gw's own, its HTTP replaced by a dict): garbage values and
replies never end polling or heartbeats, records that claim too much are refused or capped;
discovery's TLS and auth options are parsed, checked and handed to the client."""

from __future__ import annotations

import base64
import http.server
import json
import logging
import threading
import time

import pytest
import yaml
from etcd3gw import Etcd3Client

from triton_disagg.config.discovery_section import parse_discovery
from waiting import wait_until
from triton_disagg.config.discovery_section import DiscoveryConfig
from triton_disagg.errors import UserError
from triton_disagg.routing.discovery import (Load, Loads, MemberRecord, Membership, Registration,
                                             etcd, membership, registration)
from triton_disagg.routing.discovery.metrics_load import metrics_load
from triton_disagg.routing.discovery.periodic import Periodic
from triton_disagg.routing.pools import DiscoveredMembers
from triton_disagg.routing.router import Router

RECORD = MemberRecord(role="context", grpc_url="ctx-01:8001", fingerprint="f" * 64,
                      kv_blocks_total=128, tokens_per_block=8, token_address="tcp://ctx-01:5555",
                      kv_events=("tcp://ctx-01:5557", "tcp://ctx-01:5558"),
                      load=Load(free_kv_blocks=100, live_sequences=None, queued_prompt_tokens=7))


def test_round_trip():
    assert MemberRecord.from_json(RECORD.to_json()) == RECORD
    raw = json.loads(RECORD.to_json())
    assert raw["version"] == 1 and raw["load"]["live_sequences"] is None   # unknown, not 0
    assert raw["capacity"] == {"kv_blocks_total": 128, "tokens_per_block": 8}
    assert raw["kv_events"] == ["tcp://ctx-01:5557", "tcp://ctx-01:5558"]
    del raw["kv_events"]                            # a record from before the key: none
    assert MemberRecord.from_json(json.dumps(raw).encode()).kv_events == ()


@pytest.mark.parametrize("change, reason", [
    (lambda d: d.update(version=2), "version 1"),
    (lambda d: d.update(role="scheduler"), "role"),
    (lambda d: d.pop("grpc_url"), "grpc_url"),
    (lambda d: d["capacity"].update(kv_blocks_total="many"), "kv_blocks_total"),
    (lambda d: d["load"].update(free_kv_blocks=-1), "free_kv_blocks"),
    (lambda d: d.update(load=[]), "load"),
    (lambda d: d.update(kv_events="tcp://h:1"), "kv_events"),
    (lambda d: d.update(kv_events=["tcp://h:1"] * 65), "kv_events"),
    (lambda d: d.update(kv_events=["http://h:1"]), "kv_events"),
    (lambda d: d.update(kv_events=["tcp://" + "h" * 300]), "kv_events"),
    (lambda d: d.update(kv_events=[7]), "kv_events"),
])
def test_malformed_records_say_why(change, reason):
    raw = json.loads(RECORD.to_json())
    change(raw)
    with pytest.raises(ValueError, match=reason):
        MemberRecord.from_json(json.dumps(raw).encode())


def test_not_json():
    with pytest.raises(ValueError, match="not JSON"):
        MemberRecord.from_json(b"{")


METRICS = """\
# TYPE disagg_kv_blocks_used gauge
disagg_kv_blocks_used{model_instance="generation_0_0",role="generation"} 3
disagg_kv_blocks_used{model_instance="generation_1_0",role="generation"} 5
disagg_kv_blocks_used{model_instance="orchestrator_0_0",role="orchestrator"} 50
disagg_kv_blocks_total{model_instance="generation_0_0",role="generation"} 64
disagg_kv_blocks_total{model_instance="generation_1_0",role="generation"} 64
"""


def test_load_from_the_metrics_endpoint():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(METRICS.encode())

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        read = metrics_load(f"http://127.0.0.1:{server.server_port}", "generation")
        assert read() == Loads(Load(free_kv_blocks=64 + 64 - 3 - 5))   # other roles left out
        assert metrics_load(f"http://127.0.0.1:{server.server_port}", "context")() == \
            Loads(Load())
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(OSError):
        read()


# --- garbage in etcd, and records that claim too much (a fake etcd client, no process) ---

PREFIX = "/fake"


class FakeEtcd(Etcd3Client):
    """etcd3gw's own client over a dict instead of HTTP: only :meth:`post` is replaced, so
    leases, puts and ranges go through the library's real code. ``keepalive_reply`` is what
    a lease keepalive answers."""

    def __init__(self, keepalive_reply: dict | None = None):
        super().__init__("fake", 1, api_path="/v3/")
        self.kv: dict[bytes, bytes] = {}
        self.calls: dict[str, int] = {}
        self.keepalive_reply = keepalive_reply
        self.largest_reply = 0              # the most records one range reply carried

    def post(self, url, *args, json=None, **kwargs):
        path = url.split("/v3/", 1)[1]
        self.calls[path] = self.calls.get(path, 0) + 1
        if path == "lease/grant":
            return {"ID": str(self.calls[path]), "TTL": json["TTL"]}
        if path == "lease/keepalive":
            return self.keepalive_reply if self.keepalive_reply is not None else {
                "result": {"TTL": "10"}}
        if path == "kv/put":
            self.kv[base64.b64decode(json["key"])] = base64.b64decode(json["value"])
            return {}
        if path == "kv/range":                  # etcd's: [key, range_end), the first limit
            start, end = (base64.b64decode(json[k]) for k in ("key", "range_end"))
            kvs = [{"key": base64.b64encode(k).decode(), "value": base64.b64encode(v).decode()}
                   for k, v in sorted(self.kv.items()) if start <= k < end]
            served = kvs[:json["limit"]] if json.get("limit") else kvs
            self.largest_reply = max(self.largest_reply, len(served))
            return {"kvs": served, "count": str(len(kvs)), "more": len(served) < len(kvs)}
        raise AssertionError(f"the fake etcd has no {path}")


def fake(monkeypatch, client: FakeEtcd) -> FakeEtcd:
    for module in (membership, registration):
        monkeypatch.setattr(module, "connect", lambda *_, **__: client)
    return client


def put(client: FakeEtcd, record: MemberRecord) -> None:
    client.kv[etcd.member_key(PREFIX, record.role, record.grpc_url).encode()] = record.to_json()


def gen(url: str, blocks: int, free: int) -> MemberRecord:
    return MemberRecord(role="generation", grpc_url=url, fingerprint="f" * 64,
                        kv_blocks_total=blocks, tokens_per_block=16,
                        load=Load(free_kv_blocks=free))


def fast_watcher(polls: list[Membership]) -> Membership:
    """A scheduler's membership of PREFIX, not started, polling every 10 ms into ``polls``."""
    watcher = Membership(DiscoveryConfig(etcd="fake:1", prefix=PREFIX), "f" * 64,
                         poll_seconds=0.01)
    watcher.on_poll = polls.append
    return watcher


def test_a_deeply_nested_value_is_skipped_and_polling_goes_on(monkeypatch, caplog):
    """A nested [[[... once raised RecursionError out of the poll and ended it for good."""
    client = fake(monkeypatch, FakeEtcd())
    put(client, gen("good:1", 64, 64))
    client.kv[f"{PREFIX}/generation/deep:1".encode()] = b"[" * 5000 + b"]" * 5000
    client.kv[f"{PREFIX}/generation/huge:1".encode()] = b" " * 10**6 + b"{}"
    polls: list[Membership] = []
    watcher = fast_watcher(polls)
    with caplog.at_level(logging.WARNING):
        watcher.start()
        try:
            assert [m.grpc_url for m in watcher.members("generation")] == ["good:1"]
            put(client, gen("later:1", 64, 64))           # the poll goes on and sees it
            wait_until(lambda: len(watcher.members("generation")) >= 2, 5, "the later member")
            assert [m.grpc_url for m in watcher.members("generation")] == ["good:1", "later:1"]
        finally:
            watcher.close()
    assert watcher.refused >= 2 * 2 and len(polls) >= 2
    ignored = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(ignored) == 2                                # once per key and reason
    assert "nested too deep" in " ".join(ignored) and "over the 16384" in " ".join(ignored)


def test_a_flood_of_records_is_read_at_most_members_per_role_each_poll(monkeypatch, caplog):
    """300 generation records: a poll once read (and parsed) every record under the prefix,
    however many; now at most MEMBERS_PER_ROLE per role, the rest counted and logged once."""
    client = fake(monkeypatch, FakeEtcd())
    put(client, RECORD)                                     # the one context server
    for i in range(300):
        put(client, gen(f"gen-{i:03d}:1", 64, 64))
    limit = membership.MEMBERS_PER_ROLE
    polls: list[Membership] = []
    watcher = fast_watcher(polls)
    with caplog.at_level(logging.WARNING):
        watcher.start()
        try:
            wait_until(lambda: len(polls) >= 3, 5, "three polls")
        finally:
            watcher.close()
    assert client.largest_reply == limit == 256
    assert [m.grpc_url for m in watcher.members("context")] == ["ctx-01:8001"]
    assert [m.grpc_url for m in watcher.members("generation")] == [
        f"gen-{i:03d}:1" for i in range(limit)]             # the first in key order
    assert watcher.unread == {"context": 0, "generation": 300 - limit}
    floods = [r.getMessage() for r in caplog.records if "more than the" in r.getMessage()]
    assert floods == [f"etcd: 300 generation records under {PREFIX}/generation/, more than "
                      f"the {limit} a poll reads; reading the first {limit} in key order "
                      "(a writer to etcd filled it?)"]


def test_an_unreadable_range_reply_counts_as_etcd_not_answering(monkeypatch):
    """A range reply whose kvs lack a "key": the last members are kept, etcd is reported
    unreachable, and the next good reply is read."""
    client = fake(monkeypatch, FakeEtcd())
    put(client, gen("good:1", 64, 64))
    watcher = Membership(DiscoveryConfig(etcd="fake:1", prefix=PREFIX), "f" * 64,
                         poll_seconds=0.01).start()
    try:
        real_post = client.post
        client.post = lambda url, *a, json=None, **k: {"kvs": [{"value": "e30="}], "count": "1"}
        wait_until(lambda: not watcher.etcd_reachable, 10, "etcd reported unreachable")
        assert len(watcher.members("generation")) == 1          # the last members kept
        client.post = real_post
        wait_until(lambda: watcher.etcd_reachable and watcher._poller.failures == 0, 10,
                   "the next good reply read")
    finally:
        watcher.close()


def test_a_keepalive_without_result_does_not_stop_the_heartbeat(monkeypatch):
    """A keepalive reply without "result" once raised KeyError out of the beat and the
    healthy server silently left its pool; now it registers again under a fresh lease."""
    client = fake(monkeypatch, FakeEtcd(keepalive_reply={}))
    beats = Registration(DiscoveryConfig(etcd="fake:1", prefix=PREFIX, ttl_seconds=2),
                         gen("gen:1", 64, 64))
    beats.beat_seconds = beats._heartbeat.seconds = 0.01
    beats.start()
    try:
        wait_until(lambda: client.calls.get("lease/grant", 0) >= 3, 5, "three lease grants")
        assert client.calls["lease/keepalive"] >= 2
        assert client.kv[beats.key.encode()] == gen("gen:1", 64, 64).to_json()
        client.keepalive_reply = None                       # etcd answers properly again
        grants = client.calls["lease/grant"]
        time.sleep(0.2)                     # 20 beats, none of which may grant a new lease
        assert client.calls["lease/grant"] - grants <= 1 and beats.registered
    finally:
        beats._heartbeat.stop()


def test_periodic_survives_a_raising_tick_and_logs_it_once(caplog):
    ticks = []

    def tick():
        ticks.append(1)
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR):
        periodic = Periodic(tick, 0.01, "test-tick")
        periodic.start()
        wait_until(lambda: len(ticks) >= 5, 5, "five ticks")
        periodic.stop()
    assert len(ticks) >= 5 and periodic.failures == len(ticks)
    assert len([r for r in caplog.records if "test-tick" in r.getMessage()]) == 1


@pytest.mark.parametrize("change, reason", [
    (lambda d: d["load"].update(free_kv_blocks=200), "over its own kv_blocks_total"),
    (lambda d: d["capacity"].update(kv_blocks_total=2**41), "from 0 to"),
    (lambda d: d["capacity"].update(tokens_per_block=12), "power of two"),
])
def test_a_record_whose_load_exceeds_its_capacity_is_refused(change, reason):
    raw = json.loads(RECORD.to_json())
    change(raw)
    with pytest.raises(ValueError, match=reason):
        MemberRecord.from_json(json.dumps(raw).encode())


def test_an_inflated_record_no_longer_wins_every_least_loaded_pick(monkeypatch):
    """kv_blocks_total: 10**12 (all free) once drew every pick; the scheduler now caps a
    record at what its config's kv_cache.max_size x instances holds."""
    client = fake(monkeypatch, FakeEtcd())
    put(client, gen("honest:1", 64, 64))
    put(client, gen("inflated:1", 10**12, 10**12))
    block = 1024                                            # bytes per block of 16 tokens
    discovery = DiscoveryConfig(etcd="fake:1", prefix=PREFIX,
                                kv_budget={"generation": 64 * block, "context": 64 * block})
    watcher = Membership(discovery, "f" * 64, block_nbytes=lambda tpb: tpb * 64).start()
    try:
        (_, inflated) = watcher.members("generation")
        assert inflated.grpc_url == "inflated:1" and inflated.kv_blocks_total == 64
        assert inflated.load.free_kv_blocks == 64
        router = Router("generation", "least_loaded", DiscoveredMembers(watcher, "generation"))
        picked = [router.take(16).url for _ in range(6)]
        assert sorted(set(picked)) == ["honest:1", "inflated:1"], picked
    finally:
        watcher.close()


# --- discovery's TLS and auth options: parsed, checked, handed to the client ---

@pytest.fixture
def pem(tmp_path):
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (tmp_path / name).write_text("-----BEGIN CERTIFICATE-----\n")
    return tmp_path


def _discovery(pem, text: str) -> DiscoveryConfig:
    """``discovery: TEXT`` of a config in the folder ``pem``, its files checked here."""
    return parse_discovery(yaml.safe_load(text), pem, files_here=True)


def test_tls_and_auth_options_parse_and_reach_the_client(pem, monkeypatch):
    monkeypatch.setenv("ETCD_PW", "pw")
    found = _discovery(pem, "{etcd: 'e:2379', ca_file: ca.pem, cert_file: cert.pem, "
                            "key_file: key.pem, username: triton, password_env: ETCD_PW}")
    assert (found.ca_file, found.cert_file, found.key_file) == tuple(
        str(pem / n) for n in ("ca.pem", "cert.pem", "key.pem"))
    assert found.tls and (found.username, found.password_env) == ("triton", "ETCD_PW")
    client = etcd.connect(found, timeout=1.5)
    assert isinstance(client, etcd.AuthClient) and client.base_url == "https://e:2379"
    assert client.session.verify == str(pem / "ca.pem") and client.timeout == 1.5
    assert client.session.cert == (str(pem / "cert.pem"), str(pem / "key.pem"))
    assert client._credentials == {"name": "triton", "password": "pw"}
    assert not client.session.trust_env          # REQUESTS_CA_BUNDLE must not replace ca_file
    plain = etcd.connect(DiscoveryConfig(etcd="e:2379"), timeout=1.0)
    assert type(plain) is Etcd3Client and plain.base_url == "http://e:2379"


@pytest.mark.parametrize("text, message", [
    ("{etcd: 'e:2379', ca_file: nope.pem}", "discovery.ca_file: {pem}/nope.pem not found"),
    ("{etcd: 'e:2379', cert_file: cert.pem}", "discovery.cert_file and discovery.key_file: give both"),
    ("{etcd: 'e:2379', username: u}", "discovery.username and discovery.password_env: give both"),
    ("{etcd: 'e:2379', username: u, password_env: UNSET_PW_VAR}",
     "discovery.password_env: the environment variable UNSET_PW_VAR is not set"),
    ("{etcd: 'e:2379', password: x}", "discovery: unknown key 'password'"),
    ("{etcd: 'e:2379', ca_file: 3}", "discovery.ca_file: 3 must be a file path"),
])
def test_a_bad_tls_or_auth_option_is_one_line_naming_it(pem, text, message):
    with pytest.raises(UserError) as err:
        _discovery(pem, text)
    assert message.format(pem=pem) in str(err.value) and "\n" not in str(err.value)

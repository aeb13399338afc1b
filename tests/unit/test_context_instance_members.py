"""A context server of several model instances, one Triton model per instance (``context``,
``context_1``, ...): rendered so (each its own cores or GPU and KV events port), expanded by
the scheduler into one router member per instance (static urls and etcd records, whose
``models`` are bounded and checked), and routed per instance by every policy: kv_aware picks
the instance whose cache holds the prompt, in-flight counts are per instance, and a server
that did not answer is left whole."""

from __future__ import annotations

import json

import pytest
from test_router import Source, picks
from test_router_kv_aware import holds, router_over

from triton_disagg.config.disagg import parse_config
from triton_disagg.config.roles import Role, instance_models
from triton_disagg.routing.discovery.record import Load, MemberRecord, ModelRecord
from triton_disagg.routing.pools import StaticMembers, _members
from triton_disagg.routing.router import OVERLAP, Member, Router
from triton_disagg.triton.render import models_for, render

FINGERPRINT = "f" * 64


def test_context_instances_are_models_of_their_own_and_generation_is_one():
    assert instance_models(Role.CONTEXT, 3) == ("context", "context_1", "context_2")
    assert instance_models(Role.CONTEXT, 1) == ("context",)
    assert instance_models(Role.GENERATION, 2) == ("generation",)


@pytest.mark.parametrize("placement, groups", [
    ({"cpus": [0, 1, 2, 3], "instances": 2}, ["count: 1 kind: KIND_CPU"] * 2),
    ({"gpus": [2, 5]}, ["count: 1 kind: KIND_GPU gpus: [ 2 ]",
                        "count: 1 kind: KIND_GPU gpus: [ 5 ]"])])
def test_each_context_instance_renders_as_its_own_model(tmp_path, placement, groups):
    (tmp_path / "engine.json").write_text("{}")
    config = parse_config({
        "model": {"engine": str(tmp_path)},
        "context_server": {"url": "localhost:9001", "kv_events_port": 5600, **placement},
        "generation_server": {"url": "localhost:9002", "instances": 1}})
    repo = render("context", config, tmp_path / "repo", kv_events_host="10.0.0.1",
                  token_bind="0.0.0.0", kv_events_port=5600)
    assert models_for("context", config) == ("context", "context_1")
    assert sorted(p.name for p in repo.iterdir()) == ["context", "context_1"]
    for i, model in enumerate(("context", "context_1")):
        assert groups[i] in (repo / model / "config.pbtxt").read_text()
        settings = json.loads((repo / model / "settings.json").read_text())
        assert settings["kv_events_port"] == 5600 + i        # its own publisher port
        if "cpus" in placement:
            assert settings["instance_cpus"] == [[2 * i, 2 * i + 1]]   # its own cores


def test_static_members_are_one_per_context_instance_each_with_its_publisher():
    members = StaticMembers("context", ["b:1", "a:1"], 16, 5557, instances=2).members()
    assert [(m.key, m.model, m.kv_events) for m in members] == [
        ("a:1", None, ("tcp://a:5559",)), ("a:1/context_1", "context_1", ("tcp://a:5560",)),
        ("b:1", None, ("tcp://b:5557",)), ("b:1/context_1", "context_1", ("tcp://b:5558",))]
    generation = StaticMembers("generation", ["g:1"], 16, 5557, instances=2).members()
    assert [(m.key, m.kv_events) for m in generation] == [
        ("g:1", ("tcp://g:5557", "tcp://g:5558"))]           # one model of 2 instances


def _record(role: Role = Role.CONTEXT, **fields) -> MemberRecord:
    return MemberRecord(role=role, grpc_url="c:1", fingerprint=FINGERPRINT,
                        kv_blocks_total=100, tokens_per_block=16, **fields)


def test_a_discovered_server_is_a_member_per_model_its_record_names():
    busy, idle = Load(free_kv_blocks=20, queued_prompt_tokens=31), Load(free_kv_blocks=50)
    record = _record(load=Load(free_kv_blocks=70, queued_prompt_tokens=31),
                     kv_events=("tcp://c:1", "tcp://c:2"),
                     models=(ModelRecord("context", ("tcp://c:1",), busy),
                             ModelRecord("context_1", ("tcp://c:2",), idle)))
    assert MemberRecord.from_json(record.to_json()) == record
    members = _members(MemberRecord.from_json(record.to_json()))
    assert [(m.key, m.model, m.kv_events, m.kv_blocks_total, m.load) for m in members] == [
        ("c:1", None, ("tcp://c:1",), 50, busy),
        ("c:1/context_1", "context_1", ("tcp://c:2",), 50, idle)]
    old = json.loads(_record(kv_events=("tcp://c:1",)).to_json())
    del old["models"]                                      # a record from before the key
    assert [(m.key, m.kv_events) for m in _members(MemberRecord.from_json(
        json.dumps(old).encode()))] == [("c:1", ("tcp://c:1",))]


@pytest.mark.parametrize("models, words", [
    ([{"model": "orchestrator", "kv_events": []}], "not the models of a context server"),
    ([{"model": "context_1", "kv_events": []}], "not the models of a context server"),
    ([{"model": "context"}, {"model": "context_2"}], "not the models"),
    (["context"], "something other than an object"),
    ({"model": "context"}, "not a list"),
    ([{"model": "context", "kv_events": ["http://x"]}], "not a tcp:// address"),
    # an ipc socket skips CurveZMQ: a local writer to etcd could feed the router events
    ([{"model": "context", "kv_events": ["ipc:///tmp/fake"]}], "not a tcp:// address"),
    ([{"model": "context", "load": {"free_kv_blocks": 101}}], "over its own kv_blocks_total"),
    ([{"model": "context", "load": {"live_sequences": -1}}], "not a whole number"),
    ([{"model": "context", "load": []}], "load is not an object"),
    ([{"model": "context" if i == 0 else f"context_{i}"} for i in range(65)], "at most 64"),
    ([{"model": "context" if i == 0 else f"context_{i}",
       "kv_events": [f"tcp://h:{j}" for j in range(9)]} for i in range(8)], "more than 64"),
])
def test_a_records_models_are_bounded_and_checked(models, words):
    record = json.loads(_record().to_json())
    record["models"] = models
    with pytest.raises(ValueError, match=words):
        MemberRecord.from_json(json.dumps(record).encode())


def test_a_generation_record_names_one_model():
    record = json.loads(_record(Role.GENERATION).to_json())
    record["models"] = [{"model": "generation"}, {"model": "generation_1"}]
    with pytest.raises(ValueError, match="not the models of a generation server"):
        MemberRecord.from_json(json.dumps(record).encode())


def _instances(url: str, n: int = 2) -> list[Member]:
    return [Member(url, 4, 1000, kv_events=(f"ipc://{url}-{i}",), model=None if i == 0
                   else f"context_{i}") for i in range(n)]


def test_kv_aware_picks_the_instance_whose_cache_holds_the_prompt_every_time():
    one, other = _instances("a:1")
    router, index, decisions = router_over(one, other)
    prompt = list(range(40))
    holds(index, other, prompt)                    # instance 1 alone prefilled it
    for _ in range(6):                             # Triton would have split these 50/50
        assignment = router.take(len(prompt), token_ids=prompt)
        assert (assignment.url, assignment.model) == ("a:1", "context_1")
        assignment.release()
    assert decisions.modes == [("context", OVERLAP)] * 6 and router.in_flight == {}


def test_every_policy_counts_and_turns_per_instance_and_leaves_a_silent_server_whole():
    members = _instances("a:1") + _instances("b:1")
    for policy in ("round_robin", "least_loaded"):
        router = Router("context", policy, Source(*members))
        held = [router.take(10) for _ in range(4)]
        assert sorted(router.in_flight) == ["a:1", "a:1/context_1", "b:1", "b:1/context_1"]
        assert set(router.in_flight.values()) == {10}          # one request on each instance
        for assignment in held:
            assignment.release()
        assert router.in_flight == {}
        assert {router.take(10, tried=["a:1"]).url for _ in range(4)} == {"b:1"}
        router.unanswered("b:1")                                # both of its instances
        assert set(picks(router, 4)) == {"a:1"}


def test_kv_aware_falls_back_when_one_instance_of_a_server_goes_quiet():
    one, other = _instances("a:1")
    router, index, decisions = router_over(one, other)
    index.gap(other.kv_events[0], 1)              # instance 1's events gapped
    assert router.take(8, token_ids=list(range(8))).url == "a:1"
    assert decisions.modes[-1] == ("context", "fallback")


def test_each_models_load_is_read_from_its_instances_series():
    from triton_disagg.routing.discovery.metrics_load import _load
    from triton_disagg.routing.scrape import parse_metrics

    samples = parse_metrics("\n".join(
        f'disagg_{name}{{model_instance="{instance}",role="context"}} {value}'
        for instance, values in (("context_0_0", (40, 64, 10)), ("context_1_0_0", (4, 64, 0)))
        for name, value in zip(("kv_blocks_used", "kv_blocks_total", "queued_prompt_tokens"),
                               values)))
    assert _load(samples, "context", "context") == Load(24, None, 10)
    assert _load(samples, "context", "context_1") == Load(60, None, 0)
    assert _load(samples, "context", None) == Load(84, None, 10)        # the server's
    assert _load(samples, "context", "context_2") == Load()             # no such series

"""The token path's wire without a server: the ZeroMQ message schema, generation's check
of the token address, and the sockets (private ipc directories, CurveZMQ on tcp). The
orchestrator's side: tests/unit/test_orchestrator_tokens.py; the generation side:
tests/unit/test_decode_loop.py."""

from __future__ import annotations

import pickle

import msgpack
import pytest
import zmq

from triton_disagg import protocol as P
from triton_disagg import token_wire
from triton_disagg.generation.decode_loop import read_request_parameters
from triton_disagg.errors import ErrorCode, RequestError
from triton_disagg.engine.logprobs import TopLogprobs
from triton_disagg.engine.sequence import TokenEvent
from triton_disagg.token_wire import WireError
from triton_disagg.zmq_endpoints import bind, push_socket


# ---- the schema ------------------------------------------------------------------------

def test_messages_round_trip():
    events = [TokenEvent("a", [1, 2], key="ka"),
              TokenEvent("b", [3], [-0.5], finish_reason="length", seq=4, key="kb"),
              TokenEvent("c", [], error="KV handle refused", seq=1, key="kc"),
              TokenEvent("d", [], error="timed out, lost", code=ErrorCode.INVALID_ARG,
                          key="kd")]
    assert token_wire.decode_events(token_wire.encode_events(events)) == events
    assert [e.final for e in events] == [False, True, True, True]
    assert token_wire.decode_stop(token_wire.encode_stop("req-1", "k")) == ("req-1", "k")
    assert token_wire.split_key(token_wire.with_key("ipc:///x", "k")) == ("ipc:///x", "k")


def test_the_bytes_are_the_schema():
    """The wire is the event packed as it is: its fields by their names, in this order,
    those at their default left out, and the version. Peers of another build read them, so
    a renamed or reordered field changes these bytes and fails here (then bump VERSION)."""
    events = [TokenEvent("a", [1, 2], key="ka"),
              TokenEvent("b", [3], [-0.5], finish_reason="length", seq=4, key="kb",
                         top=[TopLogprobs([3, 7], [-0.5, -2.0])]),
              TokenEvent("c", [], error="KV handle refused", code=ErrorCode.UNAVAILABLE,
                         seq=1, key="kc"),
              TokenEvent("d", [], error="engine step failed", seq=2, key="kd")]
    assert token_wire.encode_events(events) == msgpack.packb({"v": 3, "events": [
        {"request_id": "a", "key": "ka", "seq": 0, "tokens": [1, 2]},
        {"request_id": "b", "key": "kb", "seq": 4, "tokens": [3], "log_probs": [-0.5],
         "finish_reason": "length", "top": [[[3, 7], [-0.5, -2.0]]]},
        {"request_id": "c", "key": "kc", "seq": 1, "tokens": [], "error": "KV handle refused",
         "code": "UNAVAILABLE"},
        {"request_id": "d", "key": "kd", "seq": 2, "tokens": [],
         "error": "engine step failed"}]})                 # INTERNAL: the default, left out
    assert token_wire.encode_stop("req-1", "k") == msgpack.packb(
        {"v": 3, "stop": "req-1", "key": "k"})
    with pytest.raises(TypeError):          # nothing but the event's own values is packed
        token_wire.encode_events([TokenEvent("e", [1], key="ke", top=[object()])])


@pytest.mark.parametrize("extra, code", [
    ({}, ErrorCode.INTERNAL),                           # a generation that sends no code yet
    ({"code": "INVALID_ARG"}, ErrorCode.INVALID_ARG),
    ({"code": "DATA_LOSS"}, ErrorCode.INTERNAL),        # a code this side does not know
])
def test_an_error_events_code_is_read_from_its_field_not_its_message(extra, code):
    frame = msgpack.packb({"v": 3, "events": [
        {"request_id": "a", "key": "k", "seq": 0, "tokens": [], "error": "unavailable: timed out",
         **extra}]})
    assert token_wire.decode_events(frame) == [
        TokenEvent("a", [], error="unavailable: timed out", code=code, key="k")]


@pytest.mark.parametrize("frame, words", [
    (msgpack.packb({"v": 1, "events": []}), ["version 1", "speaks 3"]),
    (msgpack.packb({"events": []}), ["version None"]),
    (pickle.dumps({"v": 3, "events": []}), ["not a msgpack message"]),
    (pickle.dumps(TokenEvent("a", [1])), ["not a msgpack message"]),
    (b"\x00garbage\xff", ["not"]),
    (msgpack.packb([1, 2]), ["msgpack map"]),
    (msgpack.packb({"v": 3, "events": [{"request_id": "a", "key": "k", "seq": 0, "tokens": ["x"]}]}),
     ["list of integers"]),
    (msgpack.packb({"v": 3, "events": [{"request_id": "a", "key": "k", "seq": 0, "tokens": [],
                                        "finish_reason": 3}]}), ["'finish_reason'"]),
    (msgpack.packb({"v": 3, "events": [{"request_id": "a", "tokens": []}]}), ["'key'", "'seq'"]),
    (msgpack.packb({"v": 3, "events": [{"request_id": "a", "key": "k", "seq": "0", "tokens": []}]}),
     ["'seq'"]),
    (msgpack.packb({"v": 3, "events": [{"request_id": "a", "key": "k", "seq": 0, "tokens": [1],
                                        "log_probs": ["a"]}]}), ["'log_probs'", "numbers"]),
    (msgpack.packb({"v": 3, "events": [{"request_id": "a", "key": "k", "seq": 0, "tokens": [1, 2],
                                        "log_probs": [-0.5]}]}), ["'log_probs'", "one per token"]),
    (msgpack.packb({"v": 3, "events": [{"request_id": "a", "key": "k", "seq": 0, "tokens": [1],
                                        "log_probs": [float("nan")]}]}), ["'log_probs'", "NaN"]),
    (msgpack.packb({"v": 3, "stop": 5}), ["without 'events'"]),
    (msgpack.packb({"v": 3, "events": [{"request_id": "a", "key": "k", "seq": 0, "tokens": [],
                                        "error": "x", "code": 3}]}), ["'code'"]),
    (msgpack.packb({"v": 3, "events": [{"request_id": "a", "key": "k", "seq": 0, "tokens": [],
                                        "finish_reason": "aborted"}]}), ["'finish_reason'", "length"]),
])
def test_frames_that_are_not_this_schema_are_refused(frame, words):
    with pytest.raises(WireError) as err:
        token_wire.decode_events(frame)
    for word in words:
        assert word in str(err.value)
    with pytest.raises(WireError):
        token_wire.decode_stop(frame)


def test_generation_refuses_a_request_without_a_token_address_and_key():
    with pytest.raises(RequestError, match="token_address"):
        read_request_parameters('{"request_type": "generation_only"}')
    with pytest.raises(RequestError, match="token_address.*no request key"):
        read_request_parameters('{"token_address": "ipc:///x"}')
    assert read_request_parameters('{"token_address": "ipc:///x#k"}') == (
        P.CONTEXT_AND_GENERATION, "ipc:///x#k")


def test_ipc_directories_are_private_and_a_dead_owners_are_swept(monkeypatch):
    import shutil
    import tempfile
    from pathlib import Path

    from triton_disagg import shm

    tmp_path = Path(tempfile.mkdtemp(dir="/tmp"))   # short: an ipc path has 107 bytes at most
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    me = shm.me()
    dead = tmp_path / f"{shm.PREFIX}zmq_{me.pidns}-{me.pid}-{me.start + 1}_gone"   # pid reused
    dead.mkdir()
    other = tmp_path / "someone-elses"
    other.mkdir()
    sock = zmq.Context.instance().socket(zmq.PULL)
    endpoint = bind(sock, None, "tokens")
    assert not dead.exists() and other.exists()
    assert endpoint.directory.parent == tmp_path and endpoint.directory.stat().st_mode & 0o77 == 0
    assert endpoint.address == f"ipc://{endpoint.directory / 'tokens'}"
    sock.close(linger=0)
    endpoint.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["someone-elses"]
    shutil.rmtree(tmp_path)


def test_tcp_sockets_admit_only_peers_that_hold_the_deployment_secret():
    context = zmq.Context.instance()
    pull = context.socket(zmq.PULL)
    endpoint = bind(pull, "127.0.0.1", "tokens")
    keyed = push_socket(context, endpoint.address, 10)
    keyed.send(b"from a peer with the secret")
    assert pull.poll(5000) and pull.recv() == b"from a peer with the secret"
    plain = context.socket(zmq.PUSH)                 # no CURVE at all
    guessing = context.socket(zmq.PUSH)              # CURVE, but not the deployment's key
    guessing.curve_publickey, guessing.curve_secretkey = zmq.curve_keypair()
    guessing.curve_serverkey = zmq.curve_keypair()[0]
    for intruder in (plain, guessing):
        intruder.connect(endpoint.address)
        intruder.send(b"intruder", zmq.NOBLOCK)
    assert not pull.poll(1000)
    for sock in (keyed, plain, guessing, pull):
        sock.close(linger=0)

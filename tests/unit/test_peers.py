"""Who may call context and generation (:func:`triton_disagg.triton.tensors.check_peer`): only
a request whose parameters carry this deployment's credential; the refusal is one line that
names the parameter and never the expected value."""

from __future__ import annotations

import json

import pytest

from triton_disagg import protocol as P
from triton_disagg.errors import RequestError
from triton_disagg.kv.secret import SECRET_ENV
from triton_disagg.triton import tensors


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "peers-test-secret-" + "7" * 32)


def test_the_credential_of_the_deployment_passes(secret):
    mine = tensors.peer_credential()
    tensors.check_peer(json.dumps({"request_type": "context_only", P.PEER_CREDENTIAL: mine}), "context",
                mine)
    tensors.check_peer({P.PEER_CREDENTIAL: mine}, "generation", mine)


@pytest.mark.parametrize("parameters", [
    None, "", "{}", json.dumps({"request_type": "context_only"}),
    json.dumps({P.PEER_CREDENTIAL: "0" * 64}), json.dumps({P.PEER_CREDENTIAL: 12345}),
    json.dumps({P.PEER_CREDENTIAL: ""})])
def test_a_request_without_it_is_refused_in_one_line(secret, parameters):
    mine = tensors.peer_credential()
    with pytest.raises(RequestError) as err:
        tensors.check_peer(parameters, "context", mine)
    message = str(err.value)
    assert "\n" not in message and P.PEER_CREDENTIAL in message and "ensemble" in message
    assert mine not in message and SECRET_ENV in message


def test_another_deployments_credential_is_refused(monkeypatch, secret):
    mine = tensors.peer_credential()
    monkeypatch.setenv(SECRET_ENV, "another-deployment-" + "8" * 32)
    theirs = tensors.peer_credential()
    assert theirs != mine and len(mine) == 64
    assert "7" * 32 not in mine               # derived, not the secret itself
    with pytest.raises(RequestError):
        tensors.check_peer({P.PEER_CREDENTIAL: theirs}, "generation", mine)


def test_a_lone_surrogate_or_a_non_object_is_refused_not_raised(secret):
    mine = tensors.peer_credential()
    with pytest.raises(RequestError, match=P.PEER_CREDENTIAL):
        tensors.check_peer('{"%s": "\\ud800"}' % P.PEER_CREDENTIAL, "context", mine)
    with pytest.raises(RequestError, match=P.PEER_CREDENTIAL):
        tensors.check_peer("[1, 2]", "generation", mine)

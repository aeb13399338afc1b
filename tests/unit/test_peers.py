"""Who may call context and generation (:mod:`triton_disagg.peers`): only a request whose
parameters carry this deployment's credential; the refusal is one line that names the
parameter and never the expected value."""

from __future__ import annotations

import json

import pytest

from triton_disagg import peers
from triton_disagg.errors import RequestError
from triton_disagg.kv.secret import SECRET_ENV


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "peers-test-secret-" + "7" * 32)


def test_the_credential_of_the_deployment_passes(secret):
    mine = peers.credential()
    peers.check(json.dumps({"request_type": "context_only", peers.PARAMETER: mine}), "context",
                mine)
    peers.check({peers.PARAMETER: mine}, "generation", mine)


@pytest.mark.parametrize("parameters", [
    None, "", "{}", json.dumps({"request_type": "context_only"}),
    json.dumps({peers.PARAMETER: "0" * 64}), json.dumps({peers.PARAMETER: 12345}),
    json.dumps({peers.PARAMETER: ""})])
def test_a_request_without_it_is_refused_in_one_line(secret, parameters):
    mine = peers.credential()
    with pytest.raises(RequestError) as err:
        peers.check(parameters, "context", mine)
    message = str(err.value)
    assert "\n" not in message and peers.PARAMETER in message and "ensemble" in message
    assert mine not in message and SECRET_ENV in message


def test_another_deployments_credential_is_refused(monkeypatch, secret):
    mine = peers.credential()
    monkeypatch.setenv(SECRET_ENV, "another-deployment-" + "8" * 32)
    theirs = peers.credential()
    assert theirs != mine and len(mine) == 64
    assert "7" * 32 not in mine               # derived, not the secret itself
    with pytest.raises(RequestError):
        peers.check({peers.PARAMETER: theirs}, "generation", mine)


def test_a_lone_surrogate_or_a_non_object_is_refused_not_raised(secret):
    mine = peers.credential()
    with pytest.raises(RequestError, match=peers.PARAMETER):
        peers.check('{"%s": "\\ud800"}' % peers.PARAMETER, "context", mine)
    with pytest.raises(RequestError, match=peers.PARAMETER):
        peers.check("[1, 2]", "generation", mine)

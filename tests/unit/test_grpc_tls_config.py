"""The config's ``grpc_tls`` (issue 27, M4): parsed into tritonserver's flags, every client's
TLS arguments, the orchestrator's settings and the HTTP front's flags; mistakes are one line
naming the key."""

from __future__ import annotations

import argparse

import pytest

from config_files import config_writer
from triton_disagg.config.disagg import load_config
from triton_disagg.config.settings import from_json, to_json
from triton_disagg.config.tls_section import (GrpcTLS, add_tls_flags, parse_grpc_tls,
                                              tls_flags, tls_from_flags)
from triton_disagg.errors import UserError
from triton_disagg.triton.grpc_channel import client_options
from triton_disagg.triton.render import settings


@pytest.fixture
def pem(tmp_path):
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (tmp_path / name).write_text("PEM\n")
    return tmp_path


def test_a_config_with_grpc_tls_reaches_the_server_flags_and_the_orchestrator(tmp_path):
    write, pki = config_writer(tmp_path), tmp_path / "pki"
    pki.mkdir()
    for name in ("ca.pem", "s.pem", "s.key"):
        (pki / name).write_text("PEM\n")
    cfg = load_config(write("model: {engine: engines/demo}\n"
                            "grpc_tls: {ca_file: pki/ca.pem, cert_file: pki/s.pem, "
                            "key_file: pki/s.key}\n"))
    assert cfg.grpc_tls == GrpcTLS(str(pki / "ca.pem"), str(pki / "s.pem"), str(pki / "s.key"))
    assert cfg.grpc_tls.server_args() == [
        "--grpc-use-ssl=true", f"--grpc-server-cert={pki}/s.pem",
        f"--grpc-server-key={pki}/s.key", f"--grpc-root-cert={pki}/ca.pem"]
    carried = from_json("orchestrator", to_json(settings("orchestrator", "scheduler", cfg)))
    assert carried.grpc_tls == cfg.grpc_tls
    assert load_config(write("model: {engine: engines/demo}\n")).grpc_tls is None


def test_clients_verify_the_server_and_present_a_certificate_only_when_mutual(pem):
    one_way = parse_grpc_tls({"ca_file": "ca.pem", "cert_file": "cert.pem",
                              "key_file": "key.pem"}, pem, files_here=True)
    options = client_options(one_way)
    assert options["ssl"] is True and options["root_certificates"] == str(pem / "ca.pem")
    assert "private_key" not in options and options["channel_args"]
    mutual = parse_grpc_tls({"ca_file": "ca.pem", "cert_file": "cert.pem",
                             "key_file": "key.pem", "mutual": True}, pem, files_here=True)
    assert client_options(mutual)["private_key"] == str(pem / "key.pem")
    assert client_options(mutual)["certificate_chain"] == str(pem / "cert.pem")
    assert mutual.server_args()[0] == "--grpc-use-ssl-mutual=true"
    assert "ssl" not in client_options(None)


@pytest.mark.parametrize("mutual", [False, True])
def test_the_front_gets_the_same_tls_through_its_flags(pem, mutual):
    tls = GrpcTLS(str(pem / "ca.pem"), str(pem / "cert.pem"), str(pem / "key.pem"), mutual)
    parser = argparse.ArgumentParser()
    add_tls_flags(parser)
    assert tls_from_flags(parser.parse_args(tls_flags(tls))) == tls
    assert tls_from_flags(parser.parse_args([])) is None


@pytest.mark.parametrize("raw, message", [
    ({"ca_file": "ca.pem", "cert_file": "cert.pem"}, "grpc_tls.key_file: missing"),
    ({"ca_file": "nope.pem", "cert_file": "cert.pem", "key_file": "key.pem"},
     "grpc_tls.ca_file: {pem}/nope.pem not found"),
    ({"ca_file": "ca.pem", "cert_file": "cert.pem", "key_file": "key.pem", "mutual": "yes"},
     "grpc_tls.mutual: 'yes' must be true"),
    ({"ca_file": "ca.pem", "cert_file": "cert.pem", "key_file": "key.pem", "verify": False},
     "grpc_tls: unknown key 'verify'"),
    ("on", "grpc_tls: expected a mapping like `{{ca_file: ca.pem"),
])
def test_a_bad_grpc_tls_is_one_line_naming_the_key(pem, raw, message):
    with pytest.raises(UserError) as err:
        parse_grpc_tls(raw, pem, files_here=True)
    assert message.format(pem=pem) in str(err.value) and "\n" not in str(err.value)

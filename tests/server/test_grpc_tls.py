"""gRPC between roles over TLS (issue 27, M4): with ``grpc_tls`` in the config every
tritonserver of the deployment serves gRPC over TLS and every call this project makes to one
(the scheduler's to context and generation, its peer probes, the HTTP front's relay, the
readiness checks) speaks it. Here the three roles run with ``mutual: true`` from
certificates ``openssl`` makes for the test: the guide's request through the scheduler's
front gets the offline engine's text, and the context's gRPC port, and the scheduler's (its
public door, :mod:`triton_disagg.front.public_door`), refuse a client in clear, one without
a client certificate, and one whose certificate another CA signed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import requests

import servers
from config_files import three_roles_config

PROMPT = "The quick brown fox"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
             f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def _signed(d: Path, name: str, ca: str) -> None:
    """``name.pem`` / ``name.key`` for 127.0.0.1 signed by ``ca``, good as server and client."""
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                               "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "1", "-extfile", "ext.cnf", "-out", f"{name}.pem", cwd=d)


def _ready(grpc: str, **tls) -> bool:
    import tritonclient.grpc as grpcclient

    try:
        with grpcclient.InferenceServerClient(grpc, **tls) as client:
            return bool(client.is_server_ready(client_timeout=5))
    except Exception:  # noqa: BLE001 - a refused handshake is "not ready" to this client
        return False


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _signed(d, "server", "ca")
    _signed(d, "rogue", "rogue-ca")
    return d


def test_the_roles_speak_mutual_tls_and_refuse_clients_without_it(demo_engine, tmp_path, pki):
    ctx_port, gen_port = servers.free_ports(2)
    config = three_roles_config(tmp_path, demo_engine, ctx_port, gen_port,
                                f"grpc_tls: {{ca_file: {pki}/ca.pem, cert_file: {pki}/server.pem,"
                                f" key_file: {pki}/server.key, mutual: true}}\n")
    args = ["-c", str(config)]
    with servers.serve("context", args, tmp_path / "c", http=False, grpc_port=ctx_port) as ctx, \
            servers.serve("generation", args, tmp_path / "g", http=False, grpc_port=gen_port), \
            servers.serve("scheduler", args, tmp_path / "s") as scheduler:
        reply = requests.post(f"{scheduler.front}/v1/completions", timeout=120, json={
            "model": demo_engine.name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == servers.offline_text(demo_engine)(PROMPT, 8)

        ca = str(pki / "ca.pem")
        for grpc in (ctx.grpc, scheduler.grpc):
            assert _ready(grpc, ssl=True, root_certificates=ca,
                          private_key=str(pki / "server.key"),
                          certificate_chain=str(pki / "server.pem")), grpc
            assert not _ready(grpc), f"{grpc}: a client in clear was served"
            assert not _ready(grpc, ssl=True, root_certificates=ca), \
                f"{grpc}: a client without a certificate was served"
            assert not _ready(grpc, ssl=True, root_certificates=ca,
                              private_key=str(pki / "rogue.key"),
                              certificate_chain=str(pki / "rogue.pem")), \
                f"{grpc}: a client certified by another CA was served"

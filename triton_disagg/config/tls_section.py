"""The config's ``grpc_tls`` section: TLS on the gRPC endpoint of every tritonserver of the
deployment and on every call this project makes to one (the scheduler's calls to context and
generation, its peer probes, the HTTP front's relay to the scheduler, readiness checks), so
that prompts, KV handles and the peer credential do not cross the network in clear.

Server authentication (the default): each server presents ``cert_file`` / ``key_file`` and
every client verifies it against ``ca_file``, so a server's certificate must name the host
its peers dial (the ``url`` / ``urls`` of the config, or the address it registers in etcd:
an IP address needs an IP subject alternative name). ``mutual: true`` adds client
authentication: servers accept only clients with a certificate signed by ``ca_file``, and
this project's clients present ``cert_file`` / ``key_file``. The paths are the same on every
host (one config) while each host keeps its own files there.

Triton's HTTP endpoint has no TLS of its own: keep it on loopback or a private network
(docs/architecture.md, "Trust boundaries").

Invariant: a :class:`GrpcTLS` the parser returns holds the three files as absolute paths
(present, when checked on this host).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any
# Any here: parsed YAML values and grpc client keyword values.

from triton_disagg.config.values import mapping, pem_file
from triton_disagg.errors import UserError

_FILES = ("ca_file", "cert_file", "key_file")
EXAMPLE = "grpc_tls: {ca_file: ca.pem, cert_file: server.pem, key_file: server.key}"


@dataclass(frozen=True)
class GrpcTLS:
    ca_file: str           # verifies the servers (and, mutual, the clients)
    cert_file: str         # this host's certificate: its server's, and its clients' if mutual
    key_file: str
    mutual: bool = False

    def server_args(self) -> list[str]:
        """tritonserver's flags for gRPC over TLS."""
        use = "--grpc-use-ssl-mutual=true" if self.mutual else "--grpc-use-ssl=true"
        return [use, f"--grpc-server-cert={self.cert_file}",
                f"--grpc-server-key={self.key_file}", f"--grpc-root-cert={self.ca_file}"]

    def client_kwargs(self) -> dict[str, Any]:
        """``tritonclient.grpc`` (sync or asyncio) ``InferenceServerClient`` arguments."""
        kwargs: dict[str, Any] = {"ssl": True, "root_certificates": self.ca_file}
        if self.mutual:
            kwargs.update(private_key=self.key_file, certificate_chain=self.cert_file)
        return kwargs


def parse_grpc_tls(raw: Any, base_dir: Path, files_here: bool) -> GrpcTLS | None:
    """``grpc_tls``; ``files_here`` False: its files need not exist on this host."""
    if raw is None:
        return None
    d = mapping(raw, "grpc_tls", {*_FILES, "mutual"}, like="ca_file: ca.pem, cert_file: server.pem, key_file: server.key")
    missing = [key for key in _FILES if key not in d]
    if missing:
        raise UserError(f"grpc_tls.{missing[0]}: missing; gRPC over TLS needs all three of "
                        f"ca_file, cert_file and key_file, e.g. `{EXAMPLE}`")
    mutual = d.get("mutual", False)
    if not isinstance(mutual, bool):
        raise UserError(f"grpc_tls.mutual: {mutual!r} must be true (servers also check their "
                        f"clients' certificates) or false")
    return GrpcTLS(mutual=mutual, **{key: pem_file(d[key], f"grpc_tls.{key}", base_dir,
                                                   files_here) for key in _FILES})


def tls_flags(tls: GrpcTLS | None) -> list[str]:
    """``tls`` as a process's command-line flags (the HTTP front's), [] for none."""
    if tls is None:
        return []
    return ["--grpc-ca-file", tls.ca_file, "--grpc-cert-file", tls.cert_file,
            "--grpc-key-file", tls.key_file, *(["--grpc-mutual"] if tls.mutual else [])]


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of :func:`tls_flags`."""
    for key in _FILES:
        parser.add_argument(f"--grpc-{key.replace('_', '-')}",
                            help=f"grpc_tls.{key}: gRPC to tritonserver over TLS")
    parser.add_argument("--grpc-mutual", action="store_true", help="grpc_tls.mutual")


def tls_from_flags(args: argparse.Namespace) -> GrpcTLS | None:
    """The parsed flags of :func:`add_tls_flags` -> a checked :class:`GrpcTLS`, or None."""
    given = {key: getattr(args, f"grpc_{key}") for key in _FILES
             if getattr(args, f"grpc_{key}") is not None}
    if not given and not args.grpc_mutual:
        return None
    return parse_grpc_tls({**given, "mutual": args.grpc_mutual}, Path.cwd(), files_here=True)

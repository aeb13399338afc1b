"""NetworkPolicies of a Kubernetes deployment: who may open a connection to which pods.

Each policy selects one unit's pods (``policyTypes: [Ingress]``; egress stays open) and
allows, for a unit holding

- context: the scheduler's pods on its gRPC and HTTP ports; generation's pods on any port
  (NIXL/UCX reads the KV pool over ports UCX picks);
- generation: the scheduler's pods on any port (gRPC and HTTP, and the decode loop's
  ZeroMQ control socket, bound on a port the kernel picks); context's pods on any port
  (UCX may connect either way);
- every server: its metrics port from pods of the namespace ``kubernetes.monitoring_namespace``
  (Prometheus; namespaces carry ``kubernetes.io/metadata.name``);
- the in-cluster etcd: the client port from the deployment's own role pods alone.

The scheduler's pods get no policy: clients reach them on 8000/8001 and generation pushes
tokens to them on ports the kernel picks (CurveZMQ, keyed by the deployment secret). Kubelet
probes come from the node, which the usual network plugins (Calico, Cilium) let through
whatever the policies say.

Invariant: every policy's ``podSelector`` is exactly the labels its unit's pod template
carries (:func:`.k8s_workloads.labels`), and every peer it allows is selected the same way.
"""

from __future__ import annotations

from triton_disagg.config.disagg import DisaggConfig
from triton_disagg.config.kubernetes import IN_CLUSTER, KubernetesConfig

from .k8s_workloads import SHORT, Unit, labels, metadata, units

_NAMESPACE_LABEL = "kubernetes.io/metadata.name"


def network_policies(config: DisaggConfig) -> list[dict]:
    """A policy per unit serving context or generation, and one for the in-cluster etcd."""
    k8s = config.kubernetes
    deployed = units(config)
    served = [u for u in deployed if {"context", "generation"} & set(u.roles)]
    policies = [_server_policy(unit, deployed, k8s) for unit in served]
    if k8s.etcd == IN_CLUSTER:
        policies.append(_etcd_policy(deployed, k8s))
    return policies


def _server_policy(unit: Unit, deployed: tuple[Unit, ...], k8s: KubernetesConfig) -> dict:
    scheduler = next(u for u in deployed if "scheduler" in u.roles)
    rules = []
    if "generation" in unit.roles:
        rules.append({"from": [_pods(k8s, scheduler)]})                  # any port: control
    else:
        rules.append({"from": [_pods(k8s, scheduler)],
                      "ports": [_port(f"{SHORT['context']}-{kind}") for kind in ("grpc", "http")]})
    peers = [u for u in deployed if u is not unit and u is not scheduler]
    if peers:
        rules.append({"from": [_pods(k8s, peer) for peer in peers]})    # NIXL / UCX
    rules.append({"from": [{"namespaceSelector": {"matchLabels": {
                      _NAMESPACE_LABEL: k8s.monitoring_namespace}}}],
                  "ports": [_port(f"{SHORT[role]}-metrics") for role in unit.roles]})
    return _policy(k8s, unit, rules)


def _etcd_policy(deployed: tuple[Unit, ...], k8s: KubernetesConfig) -> dict:
    roles = {"matchLabels": labels(k8s), "matchExpressions": [{
        "key": "app.kubernetes.io/component", "operator": "In",
        "values": [u.name for u in deployed]}]}
    return _policy(k8s, Unit("etcd", ()),
                   [{"from": [{"podSelector": roles}], "ports": [_port("client")]}])


def _policy(k8s: KubernetesConfig, unit: Unit, ingress: list[dict]) -> dict:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(k8s, f"{k8s.name}-{unit.name}", unit),
            "spec": {"podSelector": {"matchLabels": labels(k8s, unit)},
                     "policyTypes": ["Ingress"], "ingress": ingress}}


def _pods(k8s: KubernetesConfig, unit: Unit) -> dict:
    return {"podSelector": {"matchLabels": labels(k8s, unit)}}


def _port(name: str) -> dict:
    return {"protocol": "TCP", "port": name}

"""``triton-disagg launch k8s``: Kubernetes manifests rendered from ``disagg_config.yaml``.

Writes one YAML file per object into ``--out`` (``kubectl apply -f DIR``), plus, with
``--kustomize``, a ``kustomization.yaml`` listing them (``kubectl apply -k DIR``). What the
objects are: :mod:`.k8s_workloads` (Deployments, their config, Services, etcd),
:mod:`.k8s_network` (NetworkPolicies) and :mod:`.k8s_autoscale` (HPAs, PodMonitor, prometheus-adapter rules, Grafana dashboard).

Invariants: the output depends on the config, the flags and the dashboard file alone (no
clock, no randomness: the KV secret is a Secret the user creates, named by
``kubernetes.kv_secret``); ``--out`` must be empty or absent, so no stale manifest of an
earlier render is applied with the new ones; the local engine need not exist.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from triton_disagg.config.disagg import DisaggConfig
from triton_disagg.errors import UserError

_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def register(subparsers) -> None:
    p = subparsers.add_parser("launch", help="render deployment manifests from the config",
                              description="Render what deploys a disagg_config.yaml elsewhere.")
    targets = p.add_subparsers(dest="target", required=True, metavar="TARGET")
    k = targets.add_parser(
        "k8s", help="Kubernetes manifests (kubectl apply -f DIR, or -k DIR with --kustomize)",
        description="A Deployment per role (context, generation, scheduler) running `triton-"
                    "disagg serve ROLE`, its config as a ConfigMap, the engine from a PVC, the "
                    "scheduler's Service, etcd, NetworkPolicies (only the scheduler reaches "
                    "context and generation, only the roles reach etcd), an HPA per role on the servers' load metrics "
                    "(prometheus-adapter rules and a PodMonitor beside them) and the Grafana "
                    "dashboard. Settings: the config's `kubernetes:` section.")
    k.add_argument("-c", "--config", type=Path, required=True, help="disagg_config.yaml")
    k.add_argument("--image", required=True,
                   help="the image every server runs (the Dockerfile's cpu or gpu target)")
    k.add_argument("--out", type=Path, required=True, help="folder for the manifests (new or empty)")
    k.add_argument("-n", "--namespace", help="namespace of every object (default: kubectl's)")
    k.add_argument("--kustomize", action="store_true",
                   help="also write kustomization.yaml, for kubectl apply -k")
    k.set_defaults(func=run)


def manifests(raw: dict, config: DisaggConfig, image: str, namespace: str | None = None) -> list[dict]:
    """Every object, in the order a reader meets them: config, workloads, monitoring."""
    from .k8s_autoscale import monitoring_objects
    from .k8s_network import network_policies
    from .k8s_workloads import (deployment, etcd_objects, metadata, pod_config,
                                scheduler_service, units)
    from .k8s_yaml import to_yaml

    k8s = config.kubernetes
    objects = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata(k8s, f"{k8s.name}-config"),
         "data": {"disagg_config.yaml": to_yaml(pod_config(raw, config))}},
        *(deployment(unit, config, image) for unit in units(config)),
        scheduler_service(config),
        *etcd_objects(config),
        *network_policies(config),
        *monitoring_objects(config),
    ]
    if namespace is not None:
        for obj in objects:
            obj["metadata"]["namespace"] = namespace
    return objects


def file_name(obj: dict) -> str:
    """``<kind>-<name>.yaml``, lowercase: unique per object of one render."""
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def run(args: argparse.Namespace) -> int:
    import yaml

    from triton_disagg.config.disagg import load_config

    from .k8s_yaml import to_yaml

    if args.namespace is not None and not (_NAMESPACE.fullmatch(args.namespace)
                                           and len(args.namespace) <= 63):
        raise UserError(f"-n/--namespace: {args.namespace!r} is not a namespace name "
                        f"(lowercase letters, digits and '-', at most 63)")
    if not args.image.strip() or any(c.isspace() for c in args.image):
        raise UserError(f"--image: {args.image!r} is not an image reference; give e.g. "
                        f"registry.example.com/triton-disagg:cpu")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise UserError(f"--out {args.out}: not an empty folder; give a new one or empty it "
                        f"(an earlier render's files would be applied with the new ones)")
    config = load_config(args.config, engine_here=False)
    raw = yaml.safe_load(args.config.read_text()) or {}
    objects = manifests(raw, config, args.image, args.namespace)
    args.out.mkdir(parents=True, exist_ok=True)
    names = [file_name(obj) for obj in objects]
    for name, obj in zip(names, objects):
        (args.out / name).write_text(to_yaml(obj))
    if args.kustomize:
        kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                         "resources": names}
        (args.out / "kustomization.yaml").write_text(to_yaml(kustomization))
    apply = f"kubectl apply -{'k' if args.kustomize else 'f'} {args.out}"
    print(f"triton-disagg launch k8s: {len(objects)} objects in {args.out}; {apply}")
    return 0

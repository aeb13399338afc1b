"""The ``kubernetes:`` section of ``disagg_config.yaml``: what ``triton-disagg launch k8s``
needs beyond the serving config (every key optional)::

    kubernetes:
      name: triton-disagg              # prefix of every object's name
      engine_pvc: triton-disagg-engines    # PVC holding engine directories (default: NAME-engines)
      engine_path: demo                # the engine's folder in it (default: model.engine's name)
      etcd: in_cluster                 # or "etcd.example.net:2379", an etcd outside the manifests
      etcd_image: quay.io/coreos/etcd:v3.5.17   # the in-cluster etcd's image
      kv_secret: triton-disagg-kv      # Secret whose key `secret` is every server's
                                       # TRITON_DISAGG_KV_SECRET (default: NAME-kv)
      etcd_secret: triton-disagg-etcd  # Secret with etcd's TLS files and password, mounted
                                       # when discovery has TLS or auth (default: NAME-etcd)
      monitoring_namespace: monitoring # where Prometheus runs: the NetworkPolicies let it
                                       # reach the servers' metrics ports
      context:    {min_replicas: 1, max_replicas: 4, target_queued_prompt_tokens: 2048}
      generation: {min_replicas: 1, max_replicas: 4, target_kv_usage: 0.75}
      scheduler:  {min_replicas: 1, max_replicas: 2, target_cpu_utilization: 80}

Invariants: a loaded :class:`KubernetesConfig` is usable as is (names are DNS-1035 labels
short enough for every object made from them, 1 <= min_replicas <= max_replicas, targets
> 0); each mistake is one :class:`UserError` line naming the key and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
# Any here: parsed YAML values, checked where they are read.

from triton_disagg.config.values import count, mapping, parse_url
from triton_disagg.errors import UserError

IN_CLUSTER = "in_cluster"
DEFAULT_ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
# What each role scales on, with its default target (launch.k8s_autoscale reads the metric):
# context: queued prompt tokens per pod; generation: KV blocks used / total per pod (0-1);
# scheduler: CPU utilization in percent of its request.
TARGETS = {"context": ("target_queued_prompt_tokens", 2048),
           "generation": ("target_kv_usage", 0.75),
           "scheduler": ("target_cpu_utilization", 80)}
_KEYS = {"name", "engine_pvc", "engine_path", "etcd", "etcd_image", "kv_secret", "etcd_secret",
         "monitoring_namespace", "context", "generation", "scheduler"}
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
NAME_MAX = 40      # leaves room for "-generation-prometheus-adapter"-style suffixes in 63


@dataclass(frozen=True)
class Scaling:
    """One role's HorizontalPodAutoscaler bounds and target (``TARGETS``)."""

    min_replicas: int = 1
    max_replicas: int = 4
    target: float = 0.0


@dataclass(frozen=True)
class KubernetesConfig:
    name: str = "triton-disagg"
    engine_pvc: str = ""                 # "" until parsed: NAME-engines
    engine_path: str | None = None       # None: the folder name of model.engine
    etcd: str = IN_CLUSTER               # IN_CLUSTER, or "host:port" of an external etcd
    etcd_image: str = DEFAULT_ETCD_IMAGE
    kv_secret: str = ""                  # "" until parsed: NAME-kv
    etcd_secret: str = ""                # "" until parsed: NAME-etcd
    monitoring_namespace: str = "monitoring"
    scaling: dict[str, Scaling] = field(default_factory=dict)   # role -> as given

    def scale(self, role: str) -> Scaling:
        """``kubernetes.<role>`` as given, else the defaults (1 to 4 replicas, ``TARGETS``)."""
        return self.scaling.get(role) or Scaling(target=TARGETS[role][1])


def parse_kubernetes(raw: Any) -> KubernetesConfig:
    """The ``kubernetes`` section (absent: every default)."""
    k = mapping(raw, "kubernetes", _KEYS)
    name = _dns_label(k.get("name", KubernetesConfig.name), "kubernetes.name", NAME_MAX)
    etcd = k.get("etcd", IN_CLUSTER)
    if etcd != IN_CLUSTER:
        etcd = parse_url(etcd, "kubernetes.etcd", "etcd.example.net:2379")
    engine_path = k.get("engine_path")
    if engine_path is not None and (not isinstance(engine_path, str) or not engine_path.strip("/")
                                    or ".." in engine_path.split("/")):
        raise UserError(f"kubernetes.engine_path: {engine_path!r} must be a folder inside the "
                        f"PVC, e.g. demo or models/llama-8b")
    image = k.get("etcd_image", DEFAULT_ETCD_IMAGE)
    if not isinstance(image, str) or not image or any(c.isspace() for c in image):
        raise UserError(f"kubernetes.etcd_image: {image!r} must be an image reference, e.g. "
                        f"{DEFAULT_ETCD_IMAGE}")
    return KubernetesConfig(
        name=name, etcd=etcd, etcd_image=image,
        engine_path=engine_path.strip("/") if engine_path else None,
        engine_pvc=_dns_label(k.get("engine_pvc", f"{name}-engines"), "kubernetes.engine_pvc"),
        kv_secret=_dns_label(k.get("kv_secret", f"{name}-kv"), "kubernetes.kv_secret"),
        etcd_secret=_dns_label(k.get("etcd_secret", f"{name}-etcd"), "kubernetes.etcd_secret"),
        monitoring_namespace=_dns_label(k.get("monitoring_namespace", "monitoring"),
                                        "kubernetes.monitoring_namespace"),
        scaling={role: _scaling(k[role], role) for role in TARGETS if role in k})


def _scaling(raw: Any, role: str) -> Scaling:
    key, default = TARGETS[role]
    s = mapping(raw, f"kubernetes.{role}", {"min_replicas", "max_replicas", key})
    low = count(s.get("min_replicas", Scaling.min_replicas), f"kubernetes.{role}.min_replicas")
    high = count(s.get("max_replicas", max(low, Scaling.max_replicas)),
                 f"kubernetes.{role}.max_replicas")
    if high < low:
        raise UserError(f"kubernetes.{role}.max_replicas: {high} is below min_replicas {low}; "
                        f"raise max_replicas or lower min_replicas")
    target = s.get(key, default)
    limit = 1 if key == "target_kv_usage" else float("inf")
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= limit:
        bound = "between 0 and 1 (a fraction of the KV pool)" if limit == 1 else "> 0"
        raise UserError(f"kubernetes.{role}.{key}: {target!r} must be a number {bound}, "
                        f"e.g. {default}")
    return Scaling(min_replicas=low, max_replicas=high, target=target)


def _dns_label(raw: Any, key: str, limit: int = 63) -> str:
    if not isinstance(raw, str) or not _NAME.fullmatch(raw) or len(raw) > limit:
        raise UserError(f"{key}: {raw!r} must be a Kubernetes name: lowercase letters, digits "
                        f"and '-', starting with a letter, at most {limit} characters, e.g. "
                        f"triton-disagg")
    return raw

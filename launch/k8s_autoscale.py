"""Autoscaling and monitoring objects of a Kubernetes deployment.

The chain, from a server's metrics port to a replica count:

1. a PodMonitor (prometheus-operator) has Prometheus scrape every pod's ``*-metrics`` port;
   the operator labels each series with its ``namespace`` and ``pod``;
2. the prometheus-adapter rules (:func:`adapter_rules`, carried in a ConfigMap to merge
   into the adapter's config) serve per-pod custom metrics: ``disagg_queued_prompt_tokens``
   (context: prompt tokens waiting, summed over the pod's model instances) and
   ``disagg_kv_usage_ratio`` (generation: KV blocks used / total over the pod's instances);
3. one HorizontalPodAutoscaler (autoscaling/v2) per autoscaled Deployment holds the pods'
   average at the role's target (``kubernetes.<role>``); the scheduler scales on CPU.

The servers label their series ``role`` and ``model_instance`` (Prometheus keeps
``instance`` for the scrape target). The Grafana dashboard ships as a ConfigMap labelled
``grafana_dashboard: "1"``, the label Grafana's dashboard sidecar looks for.
"""

from __future__ import annotations

from pathlib import Path

from triton_disagg.config.disagg import DisaggConfig
from triton_disagg.config.roles import Role

from .k8s_workloads import SHORT, Unit, labels, metadata, units
from .k8s_yaml import to_yaml

DASHBOARD = Path(__file__).resolve().parent / "grafana-dashboard.json"   # package data: a wheel has it
SCRAPE_INTERVAL = "5s"
QUEUED_TOKENS = "disagg_queued_prompt_tokens"      # the servers' gauge, and the custom metric
KV_USAGE = "disagg_kv_usage_ratio"                 # custom metric: used / total blocks
_POD = {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}}


def adapter_rules() -> list[dict]:
    """prometheus-adapter ``rules`` serving the two custom metrics per pod."""
    return [
        {"seriesQuery": f'{QUEUED_TOKENS}{{namespace!="",pod!="",role="context"}}',
         "resources": _POD,
         "name": {"matches": f"^{QUEUED_TOKENS}$", "as": QUEUED_TOKENS},
         "metricsQuery": 'sum(<<.Series>>{<<.LabelMatchers>>,role="context"}) by (<<.GroupBy>>)'},
        {"seriesQuery": 'disagg_kv_blocks_used{namespace!="",pod!="",role="generation"}',
         "resources": _POD,
         "name": {"matches": "^disagg_kv_blocks_used$", "as": KV_USAGE},
         "metricsQuery": ('sum(disagg_kv_blocks_used{<<.LabelMatchers>>,role="generation"}) by '
                          '(<<.GroupBy>>) / sum(disagg_kv_blocks_total{<<.LabelMatchers>>,'
                          'role="generation"}) by (<<.GroupBy>>)')},
    ]


def hpa(unit: Unit, config: DisaggConfig) -> dict:
    """The HorizontalPodAutoscaler of an autoscaled (not ``single``) one-role unit."""
    (role,) = unit.roles
    k8s = config.kubernetes
    scaling = k8s.scale(role)
    name = f"{k8s.name}-{unit.name}"
    if role == Role.CONTEXT:
        metric = _pods_metric(QUEUED_TOKENS, str(int(scaling.target)))
    elif role == Role.GENERATION:
        metric = _pods_metric(KV_USAGE, f"{round(scaling.target * 1000)}m")
    else:
        metric = {"type": "Resource", "resource": {"name": "cpu", "target": {
            "type": "Utilization", "averageUtilization": int(scaling.target)}}}
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": metadata(k8s, name, unit),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": name},
                     "minReplicas": scaling.min_replicas, "maxReplicas": scaling.max_replicas,
                     "metrics": [metric]}}


def _pods_metric(name: str, average: str) -> dict:
    return {"type": "Pods", "pods": {"metric": {"name": name},
                                     "target": {"type": "AverageValue", "averageValue": average}}}


def monitoring_objects(config: DisaggConfig) -> list[dict]:
    """The HPAs, the PodMonitor, the adapter rules' ConfigMap and the dashboard's ConfigMap."""
    k8s = config.kubernetes
    deployed = units(config)
    roles = [role for unit in deployed for role in unit.roles]
    objects = [hpa(unit, config) for unit in deployed if not unit.single]
    objects.append({
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": metadata(k8s, k8s.name),
        "spec": {"selector": {"matchLabels": labels(k8s)},
                 "podMetricsEndpoints": [{"port": f"{SHORT[role]}-metrics", "path": "/metrics",
                                          "interval": SCRAPE_INTERVAL} for role in roles]}})
    objects.append({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": metadata(k8s, f"{k8s.name}-prometheus-adapter"),
        "data": {"config.yaml": to_yaml({"rules": adapter_rules()})}})
    objects.append({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {**metadata(k8s, f"{k8s.name}-grafana-dashboard"),
                     "labels": {**labels(k8s), "grafana_dashboard": "1"}},
        "data": {"triton-disagg.json": DASHBOARD.read_text()}})
    return objects

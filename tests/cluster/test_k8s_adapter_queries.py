"""The prometheus-adapter rules that ``launch k8s`` renders are queries a real Prometheus
answers over a real server's series, per pod, as the HPAs read them.

A ``serve all`` of the demo engine is scraped by Debian's Prometheus (tests/support/prometheus_server.py)
with the ``namespace`` and ``pod`` labels that prometheus-operator's PodMonitor adds in a
cluster. Each rule's ``seriesQuery`` must find series, and its ``metricsQuery``, filled in as
the adapter fills it for one pod (``<<.Series>>`` the series' name, ``<<.LabelMatchers>>``
that pod's namespace and name, ``<<.GroupBy>>`` ``pod``), must give one value for that pod:
for generation's KV usage, the server's own used / total blocks of role generation.
"""

from __future__ import annotations

import re
import time

import pytest

import prometheus_server
import servers
from triton_disagg.routing.scrape import parse_metrics, total
from triton_disagg.launch.k8s_autoscale import KV_USAGE, QUEUED_TOKENS, adapter_rules

NAMESPACE, POD = "llm", "triton-disagg-generation-7d9f-x2x4q"
SCRAPED_WITHIN = 20.0


def adapter_query(rule: dict) -> str:
    """``rule["metricsQuery"]`` as prometheus-adapter fills it for the pod ``POD``."""
    series = re.match(r"\w+", rule["seriesQuery"]).group(0)
    return (rule["metricsQuery"].replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", f'namespace="{NAMESPACE}",pod="{POD}"')
            .replace("<<.GroupBy>>", "pod"))


def _until_found(prom: prometheus_server.PrometheusServer, expr: str) -> list[dict]:
    deadline = time.monotonic() + SCRAPED_WITHIN
    while not (found := prom.query(expr)):
        assert time.monotonic() < deadline, f"no series for {expr} within {SCRAPED_WITHIN} s"
        time.sleep(0.2)
    return found


@pytest.mark.parametrize("metric", [KV_USAGE, QUEUED_TOKENS])
def test_each_adapter_rule_gives_the_pods_value(metric, demo_engine, tmp_path):
    (rule,) = [r for r in adapter_rules() if r["name"]["as"] == metric]
    with servers.serve("all", ["--engine", str(demo_engine)], tmp_path / "serve") as served, \
            prometheus_server.PrometheusServer(served.metrics, tmp_path / "prometheus",
                                               {"namespace": NAMESPACE, "pod": POD}) as prom:
        assert "".join(servers.grpc_stream(served.grpc, servers.PROMPTS[0], 8))
        _until_found(prom, rule["seriesQuery"])
        (sample,) = _until_found(prom, adapter_query(rule))
        assert sample["metric"] == {"pod": POD}
        if metric == KV_USAGE:
            own = parse_metrics(servers.metrics(served.metrics))
            used = total(own, "disagg_kv_blocks_used", role="generation")
            blocks = total(own, "disagg_kv_blocks_total", role="generation")
            assert blocks > 0 and float(sample["value"][1]) == used / blocks

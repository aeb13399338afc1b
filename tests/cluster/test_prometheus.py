"""A real Prometheus (Debian's) scraping `serve all` with the shipped scrape config.

Checked through Prometheus's HTTP API: the project's series keep their own labels
(``model_instance``, ``role``) beside the ``instance`` and ``job`` Prometheus adds, so
nothing is renamed to ``exported_instance``; and every query of the Grafana dashboard
returns data, with one distinct legend per series (a legend naming a label Prometheus
overwrote would show the scrape target for every model instance alike). The soak's
reader of the pool gauges finds the same model instances on the endpoint itself.
"""

from __future__ import annotations

import json
import re
import time
import urllib.parse

import prometheus_server
import servers
from servers import PROMPTS
from triton_disagg.launch.k8s_autoscale import DASHBOARD
from triton_disagg.routing.scrape import by_label, scrape
from triton_disagg.triton.metrics import MODEL_INSTANCE

RATE_WINDOW = "30s"          # stands in for Grafana's $__rate_interval (>= 4 scrape intervals)
SCRAPED_TIMEOUT = 30.0
FINISHED = 'sum(disagg_requests_total{role="orchestrator",outcome="finished"})'


def _dashboard_targets() -> list[dict]:
    return [t for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]


def _legend(fmt: str, labels: dict) -> str:
    """Grafana's rendering of ``legendFormat``: ``{{name}}`` becomes the label's value."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def _wait_scraped(prom: prometheus_server.PrometheusServer, expr: str, want: float) -> None:
    deadline = time.monotonic() + SCRAPED_TIMEOUT
    while True:
        got = prom.query(expr)
        if got and float(got[0]["value"][1]) == want:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"Prometheus did not see {expr} == {want} within "
                                 f"{SCRAPED_TIMEOUT} s: {got}")
        time.sleep(0.5)


def test_prometheus_keeps_the_labels_and_the_dashboard_answers(demo_engine, tmp_path):
    config = (f"model: {{engine: {demo_engine}}}\ngeneration_server: {{instances: 2}}\n"
              f"kv_cache: {{max_size: 64MB}}\n")
    with servers.serve_config(config, tmp_path / "serve") as served, \
            prometheus_server.PrometheusServer(served.metrics, tmp_path / "prometheus") as prom:
        # Two rounds, each seen by Prometheus, so every rate() has two samples and rises.
        for done in (len(PROMPTS), 2 * len(PROMPTS)):
            for prompt in PROMPTS:
                assert "".join(servers.grpc_stream(served.grpc, prompt, 12))
            _wait_scraped(prom, FINISHED, done)
        assert prom.targets_up()
        project = prom.query('{__name__=~"disagg_.+"}')
        exported = prom.query('{exported_instance!=""}')
        answers = {t["expr"]: prom.query(t["expr"].replace("$__rate_interval", RATE_WINDOW))
                   for t in _dashboard_targets()}
        pools = by_label(scrape(served.metrics), "disagg_kv_blocks_used", MODEL_INSTANCE)

    target = urllib.parse.urlsplit(served.metrics).netloc
    assert project and not exported, exported[:3]
    for series in project:
        labels = series["metric"]
        assert labels.get("model_instance") and labels.get("role"), labels
        assert (labels["instance"], labels["job"], labels["deployment"]) == (
            target, "triton-disagg", "all-in-one"), labels
    generation = {s["metric"]["model_instance"] for s in project
                  if s["metric"]["__name__"] == "disagg_kv_blocks_total"
                  and s["metric"]["role"] == "generation"}
    assert len(generation) == 2, generation

    empty = [expr for expr, result in answers.items() if not result]
    assert not empty, f"dashboard queries without data: {empty}"
    for t in _dashboard_targets():
        result, fmt = answers[t["expr"]], t.get("legendFormat", "")
        for series in result:
            missing = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", fmt)) - set(series["metric"])
            assert not missing, (t["expr"], fmt, series["metric"])
        legends = [_legend(fmt, s["metric"]) for s in result]
        assert len(set(legends)) == len(legends), (t["expr"], legends)
    per_instance = answers["disagg_kv_blocks_used"]
    assert {s["metric"]["model_instance"] for s in per_instance} >= generation
    assert set(pools) == {s["metric"]["model_instance"] for s in per_instance}, pools
    by_outcome = {s["metric"]["outcome"]: float(s["value"][1]) for s in answers[
        'sum by (outcome) (rate(disagg_requests_total{role="orchestrator"}[$__rate_interval]))']}
    assert by_outcome["finished"] > 0, by_outcome

"""``triton-disagg launch k8s`` renders manifests a cluster accepts and that run the serving
commands (the pods themselves run in tests/cluster/test_k8s_commands.py).

- Every object of the example configs (disagg_config.yaml, examples/three_roles.yaml, the
  2x2 GPU examples/k8s_gpu.yaml) and of the host_memory and aggregated variants validates,
  strictly (no unknown field), against the Kubernetes 1.37 schemas of
  ``kubernetes-validate``, with zero errors. The PodMonitor is a prometheus-operator CRD,
  which those schemas do not hold: it is NOT schema-checked; instead it is checked against
  the pods it must scrape (its selector matches every server pod, its ports are theirs).
- Each container's command is :func:`serve_argv` of its role, and the serve parser takes
  it; its readiness probe names its HTTP front (`/healthz`) and its liveness probes its
  HTTP port, which the command opens; the Deployment selects its
  pods; the HPA targets a Deployment of the render and a metric the adapter rules serve.
- Every server pod runs as the images' non-root user (launch k8s's RUN_AS) under the
  "restricted" Pod Security Standard's settings: runAsNonRoot, fsGroup, the runtime's
  seccomp profile, no privilege escalation, every capability dropped, no host IPC.
- The pods' config loads and keeps the user's settings.
- A bad ``kubernetes:`` key is one error line naming it.
- NetworkPolicies: context and generation pods admit the scheduler's pods (context: on its
  gRPC and HTTP ports alone), each other (NIXL), and the monitoring namespace on their
  metrics ports; the in-cluster etcd admits the role pods on its client port and listens on
  its pod IP, not 0.0.0.0. Every selector matches the pods it means.
- discovery's TLS and auth reach the pods: the etcd Secret mounted, the pods' config naming
  the files in it and the password's variable, the in-cluster etcd serving https.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from k8s_manifests import CRD_KINDS, IMAGE, of_kind, render, schema_errors
from triton_disagg.cli import build_parser
from triton_disagg.config.disagg import parse_config
from triton_disagg.launch.drain import DRAIN_SECONDS, NOTICE_SECONDS
from triton_disagg.launch.k8s_workloads import (CONFIG_PATH, CONTAINER_SECURITY, ETCD_PASSWORD_ENV,
                                                ETCD_TLS_DIR, POD_SECURITY, PORTS, READY_PATH,
                                                LIVE_PATH, RUN_AS)
from triton_disagg.launch.serve_argv import serve_argv
from triton_disagg.triton.tritonserver import STOP_GRACE_SECONDS

ROOT = Path(__file__).resolve().parents[2]


def _variant(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "variant.yaml"
    path.write_text(f"model: {{engine: {ROOT / 'engines' / 'demo'}}}\n" + text)
    return path


CONFIGS = {
    "root": lambda tmp: ROOT / "disagg_config.yaml",
    "three_roles": lambda tmp: ROOT / "examples" / "three_roles.yaml",
    "gpu_2x2": lambda tmp: ROOT / "examples" / "k8s_gpu.yaml",
    "host_memory": lambda tmp: _variant(tmp, "kv_cache: {strategy: host_memory, max_size: 512MiB}\n"
                                             "context_server: {instances: 2}\n"),
    "aggregated": lambda tmp: _variant(tmp, "mode: aggregated\n"
                                            "kubernetes: {etcd: \"etcd.example.net:2379\"}\n"),
    "etcd_tls_auth": lambda tmp: _variant(tmp, TLS_AUTH),
}
TLS_AUTH = ("discovery: {etcd: 'e:2379', ca_file: /pki/ca.pem, cert_file: /pki/c.pem, "
            "key_file: /pki/c.key, username: triton, password_env: ETCD_PW}\n")


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_every_object_validates_and_runs_the_serve_command(which, tmp_path):
    objects = render(CONFIGS[which](tmp_path), tmp_path / "out", "--kustomize", "-n", "llm")
    assert schema_errors(objects) == []
    kustomization = objects.pop("kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(objects)
    assert {obj["metadata"]["namespace"] for obj in objects.values()} == {"llm"}
    assert {obj["kind"] for obj in objects.values()} - {
        "ConfigMap", "Deployment", "Service", "StatefulSet", "HorizontalPodAutoscaler",
        "NetworkPolicy"} == CRD_KINDS

    serve = build_parser()
    deployments = {d["metadata"]["name"]: d for d in of_kind(objects, "Deployment")}
    for deployment in deployments.values():
        pod = deployment["spec"]["template"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert pod["spec"]["restartPolicy"] == "Always"
        assert pod["spec"]["securityContext"] == POD_SECURITY and "hostIPC" not in pod["spec"]
        assert POD_SECURITY["runAsUser"] == RUN_AS > 0 and POD_SECURITY["runAsNonRoot"]
        # a stopping server drains, then stops tritonserver: the kubelet must not kill it first
        assert pod["spec"]["terminationGracePeriodSeconds"] > (
            NOTICE_SECONDS + DRAIN_SECONDS + STOP_GRACE_SECONDS)
        for container in pod["spec"]["containers"]:
            role, ports = container["name"], PORTS[container["name"]]
            advertise = None if role == "scheduler" else f"$(POD_IP):{ports['grpc']}"
            assert container["command"] == serve_argv(role, CONFIG_PATH, "0.0.0.0", ports["grpc"],
                                                      ports["metrics"], ports["http"], advertise,
                                                      ports["front"])
            assert container["securityContext"] == CONTAINER_SECURITY == {
                "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
            args = serve.parse_args(container["command"][1:])
            declared = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert sorted(declared.values()) == sorted([args.http_port, args.grpc_port,
                                                        args.metrics_port, args.front_port])
            # ready: the role's HTTP front's /healthz; live: the metrics port (its door)
            for probe, path, port in (("readinessProbe", READY_PATH, args.front_port),
                                      ("livenessProbe", LIVE_PATH, args.metrics_port),
                                      ("startupProbe", LIVE_PATH, args.metrics_port)):
                get = container[probe]["httpGet"]
                assert get["path"] == path and declared[get["port"]] == port
            if advertise:
                env = {e["name"]: e for e in container["env"]}
                assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert {m["mountPath"] for m in container["volumeMounts"]} >= {
                str(Path(CONFIG_PATH).parent), "/dev/shm"}

    metrics_ports = {p["name"] for d in deployments.values()
                     for c in d["spec"]["template"]["spec"]["containers"] for p in c["ports"]
                     if p["name"].endswith("-metrics")}
    (monitor,) = of_kind(objects, "PodMonitor")
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == metrics_ports
    for d in deployments.values():
        assert monitor["spec"]["selector"]["matchLabels"].items() <= \
            d["spec"]["template"]["metadata"]["labels"].items()

    adapter = next(o for o in of_kind(objects, "ConfigMap") if "config.yaml" in o["data"])
    served = {rule["name"]["as"] for rule in yaml.safe_load(adapter["data"]["config.yaml"])["rules"]}
    for hpa in of_kind(objects, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Pods":
                assert metric["pods"]["metric"]["name"] in served


def test_gpu_pods_ask_for_their_gpus_and_host_memory_pods_share_shm(tmp_path):
    gpu = render(ROOT / "examples" / "k8s_gpu.yaml", tmp_path / "gpu")
    for role in ("context", "generation"):
        (container,) = gpu[f"deployment-llm-{role}.yaml"]["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert gpu["horizontalpodautoscaler-llm-generation.yaml"]["spec"]["minReplicas"] == 2

    shared = render(CONFIGS["host_memory"](tmp_path), tmp_path / "shm")
    pair = shared["deployment-triton-disagg-context-generation.yaml"]
    pod = pair["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["context", "generation"]
    assert pair["spec"]["replicas"] == 1
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{64 + 2 * 512}Mi"}
    assert "horizontalpodautoscaler-triton-disagg-context-generation.yaml" not in shared


def test_pods_config_loads_and_keeps_the_users_settings(tmp_path):
    objects = render(ROOT / "examples" / "three_roles.yaml", tmp_path / "out")
    text = objects["configmap-triton-disagg-config.yaml"]["data"]["disagg_config.yaml"]
    pods = parse_config(yaml.safe_load(text), engine_here=False)
    source = parse_config(yaml.safe_load((ROOT / "examples" / "three_roles.yaml").read_text()),
                          base_dir=ROOT / "examples", engine_here=False)
    assert str(pods.engine) == "/engines/demo"
    assert pods.discovery.etcd == "triton-disagg-etcd:2379"
    assert pods.kv_cache == source.kv_cache and pods.mode == source.mode
    for role in ("context", "generation"):
        assert pods.server(role).urls == () and pods.server(role).cpus == ()
        assert pods.server(role).instances == source.server(role).instances


@pytest.mark.parametrize("section, message", [
    ("{name: Triton}", "kubernetes.name: 'Triton' must be a Kubernetes name"),
    ("{generation: {min_replicas: 3, max_replicas: 2}}",
     "kubernetes.generation.max_replicas: 2 is below min_replicas 3"),
    ("{generation: {target_kv_usage: 1.5}}", "kubernetes.generation.target_kv_usage: 1.5 must be"),
    ("{etcd: nowhere}", "kubernetes.etcd: 'nowhere' is not host:port"),
    ("{replicas: 2}", "kubernetes: unknown key 'replicas'"),
    ("{engine_path: ../x}", "kubernetes.engine_path: '../x' must be a folder inside the PVC"),
    ("{etcd_secret: Etcd}", "kubernetes.etcd_secret: 'Etcd' must be a Kubernetes name"),
])
def test_a_bad_kubernetes_key_is_one_line_naming_it(section, message, tmp_path):
    config = _variant(tmp_path, f"kubernetes: {section}\n")
    done = subprocess.run([sys.executable, "-m", "triton_disagg.cli", "launch", "k8s", "-c",
                           str(config), "--image", IMAGE, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_grpc_tls_is_refused_in_one_line_until_pods_mount_certificates(tmp_path):
    for name in ("ca.pem", "s.pem", "s.key"):
        (tmp_path / name).write_text("PEM\n")
    config = _variant(tmp_path, f"grpc_tls: {{ca_file: {tmp_path}/ca.pem, cert_file: "
                                f"{tmp_path}/s.pem, key_file: {tmp_path}/s.key}}\n")
    done = subprocess.run([sys.executable, "-m", "triton_disagg.cli", "launch", "k8s", "-c",
                           str(config), "--image", IMAGE, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "grpc_tls: launch k8s does not mount certificates" in done.stderr
    assert not (tmp_path / "out").exists()


def test_host_memory_refuses_scaling_and_out_must_be_empty(tmp_path):
    config = _variant(tmp_path, "kv_cache: {strategy: host_memory}\n"
                                "kubernetes: {context: {max_replicas: 3}}\n")
    done = subprocess.run([sys.executable, "-m", "triton_disagg.cli", "launch", "k8s", "-c",
                           str(config), "--image", IMAGE, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "kubernetes.context.max_replicas: 3" in done.stderr
    render(ROOT / "disagg_config.yaml", tmp_path / "again")
    shutil.copy(ROOT / "disagg_config.yaml", tmp_path / "again" / "stale.yaml")
    done = subprocess.run([sys.executable, "-m", "triton_disagg.cli", "launch", "k8s", "-c",
                           str(ROOT / "disagg_config.yaml"), "--image", IMAGE, "--out",
                           str(tmp_path / "again")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "not an empty folder" in done.stderr


def _adapter_series() -> list[str]:
    from triton_disagg.launch.k8s_autoscale import adapter_rules

    text = " ".join(f"{r['seriesQuery']} {r['metricsQuery']}" for r in adapter_rules())
    return sorted(set(re.findall(r"disagg_\w+", text)))


@pytest.mark.parametrize("series", _adapter_series())
def test_the_adapter_reads_series_the_servers_publish(series):
    from triton_disagg.triton.metrics import _FAMILIES

    assert series in {name for name, _, _ in _FAMILIES.values()}


def _selects(selector: dict, pod_labels: dict) -> bool:
    """Whether a LabelSelector (matchLabels, matchExpressions with In) selects ``pod_labels``."""
    if not selector.get("matchLabels", {}).items() <= pod_labels.items():
        return False
    return all(e["operator"] == "In" and pod_labels.get(e["key"]) in e["values"]
               for e in selector.get("matchExpressions", []))


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_network_policies_let_only_the_scheduler_reach_the_servers(which, tmp_path):
    objects = render(CONFIGS[which](tmp_path), tmp_path / "out")
    pods = {o["metadata"]["name"]: o["spec"]["template"] for o in objects.values()
            if o["kind"] in ("Deployment", "StatefulSet")}
    roles = {name: {c["name"] for c in t["spec"]["containers"]} for name, t in pods.items()}
    ports = {name: {p["name"] for c in t["spec"]["containers"] for p in c["ports"]}
             for name, t in pods.items()}

    def selected(selector: dict) -> set[str]:
        return {name for name, t in pods.items() if _selects(selector, t["metadata"]["labels"])}

    policies = of_kind(objects, "NetworkPolicy")
    guarded = {}
    for policy in policies:
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        (target,) = selected(spec["podSelector"])
        guarded[target] = policy
        for rule in spec["ingress"]:
            assert rule["from"], "a rule without peers admits everyone"
            for port in rule.get("ports", []):
                assert port["port"] in ports[target]         # named ports of the target pods
    servers = {name for name, r in roles.items() if r & {"context", "generation"}}
    assert servers <= set(guarded)
    (scheduler,) = [name for name, r in roles.items() if r == {"scheduler"}]
    assert scheduler not in guarded                          # clients reach it
    for name in servers:
        rules = guarded[name]["spec"]["ingress"]
        by_pods = [(selected(peer["podSelector"]), rule.get("ports")) for rule in rules
                   for peer in rule["from"] if "podSelector" in peer]
        assert all(not peers & {name} for peers, _ in by_pods)
        assert {p for peers, _ in by_pods for p in peers} <= servers | {scheduler}
        (from_scheduler,) = [p for peers, p in by_pods if peers == {scheduler}]
        if roles[name] == {"context"}:
            assert {p["port"] for p in from_scheduler} == {"ctx-grpc", "ctx-http"}
        monitoring = [rule for rule in rules for peer in rule["from"]
                      if "namespaceSelector" in peer]
        (metrics,) = monitoring
        assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}}}]
        assert {p["port"] for p in metrics["ports"]} == {p for p in ports[name]
                                                         if p.endswith("-metrics")}
    etcd = [name for name, r in roles.items() if r == {"etcd"}]
    if etcd:
        (rule,) = guarded[etcd[0]]["spec"]["ingress"]
        assert selected(rule["from"][0]["podSelector"]) == servers | {scheduler}
        assert rule["ports"] == [{"protocol": "TCP", "port": "client"}]
        command = " ".join(pods[etcd[0]]["spec"]["containers"][0]["command"])
        assert "0.0.0.0" not in command and "://$(POD_IP):2379" in command
        # the restricted profile, as the servers' pods: non-root, nothing escalates
        assert pods[etcd[0]]["spec"]["securityContext"] == POD_SECURITY
        assert pods[etcd[0]]["spec"]["containers"][0]["securityContext"] == CONTAINER_SECURITY
    else:
        assert which == "aggregated"


def test_etcd_tls_and_auth_reach_the_pods(tmp_path):
    objects = render(_variant(tmp_path, TLS_AUTH), tmp_path / "out")
    text = objects["configmap-triton-disagg-config.yaml"]["data"]["disagg_config.yaml"]
    found = parse_config(yaml.safe_load(text), engine_here=False).discovery
    assert (found.ca_file, found.cert_file, found.key_file) == (
        f"{ETCD_TLS_DIR}/ca.crt", f"{ETCD_TLS_DIR}/tls.crt", f"{ETCD_TLS_DIR}/tls.key")
    assert (found.username, found.password_env) == ("triton", ETCD_PASSWORD_ENV)
    for obj in of_kind(objects, "Deployment") + of_kind(objects, "StatefulSet"):
        spec = obj["spec"]["template"]["spec"]
        assert {"name": "etcd-tls", "secret": {"secretName": "triton-disagg-etcd",
                                               "defaultMode": 0o440}} in spec["volumes"]
        for container in spec["containers"]:
            assert {"name": "etcd-tls", "mountPath": ETCD_TLS_DIR, "readOnly": True} in \
                container["volumeMounts"]
            if container["name"] != "etcd":
                env = {e["name"]: e for e in container["env"]}
                assert env[ETCD_PASSWORD_ENV]["valueFrom"]["secretKeyRef"] == {
                    "name": "triton-disagg-etcd", "key": "password"}
    (etcd,) = of_kind(objects, "StatefulSet")
    command = etcd["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "https://$(POD_IP):2379,https://127.0.0.1:2379" in command
    assert "--client-cert-auth" in command and f"{ETCD_TLS_DIR}/server.crt" in command

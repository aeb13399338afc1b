"""The pods of ``launch k8s`` work: each container's command, run as the kubelet would run it,
starts a working role.

The manifests are rendered by the CLI for a config whose etcd is external
(``kubernetes.etcd``, a real etcd on a host of its own). Each Deployment's pod becomes a
network-namespace host (:mod:`netns_hosts`, as tests/cluster/test_netns_pools.py runs servers),
and each container's command runs there as the kubelet would start it: its ``env`` set
(the downward API's ``status.podIP`` is the host's address, the KV Secret a test value),
``$(VAR)`` in the command expanded from that env, and its volumes mounted: the ConfigMap's
files and a folder holding the engine under the PVC's folder name stand at their mount
paths (the paths in the command and in the pods' config are mapped to them, the one
liberty taken, since the hosts share this machine's filesystem). The only other change is
the program: ``triton-disagg`` runs as this interpreter's ``python -m triton_disagg.cli``.

Then every probe of every container answers 200 on the port and path the manifest names,
both servers register through etcd, and streams through the scheduler's gRPC port give the
offline engine's greedy text.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

import etcd_server
import servers
from k8s_manifests import of_kind, render
from netns_hosts import grpc_streams, hosts_fixture, scrape
from triton_disagg.routing.scrape import parse_metrics, total
from triton_disagg.launch.k8s_workloads import PORTS

PODS = {"triton-disagg-context": "context", "triton-disagg-generation": "generation",
        "triton-disagg-scheduler": "scheduler"}
HOSTS = ("etcd", *PODS.values())
ETCD_PORT = 2379
SECRETS = {("triton-disagg-kv", "secret"): "k8s-pods-" + "5" * 32}
MAX_TOKENS = 24
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


hosts = hosts_fixture(HOSTS)


def kubelet_env(container: dict, pod_ip: str) -> dict[str, str]:
    """The container's ``env`` as the kubelet sets it (the kinds the manifests use)."""
    env = {}
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[item["name"]] = pod_ip
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[item["name"]] = SECRETS[(ref["name"], ref["key"])]
        else:
            raise AssertionError(f"an env source this test does not emulate: {item}")
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined VAR is replaced, ``$$`` is ``$``, an
    undefined reference stays as written."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                    text)


def mount(path: str, mounts: dict[str, Path]) -> str:
    """``path`` inside a pod -> where its volume stands on this machine."""
    for inside, outside in mounts.items():
        if path == inside or path.startswith(inside + "/"):
            return str(outside) + path[len(inside):]
    return path


def test_each_pods_command_starts_a_working_role(demo_engine, tmp_path, hosts):
    etcd = f"{hosts.address('etcd')}:{ETCD_PORT}"
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\n"
                      "context_server: {cpus: [0]}\ngeneration_server: {cpus: [1]}\n"
                      "kv_cache: {strategy: direct_transfer, max_size: 64MB}\n"
                      f"kubernetes: {{etcd: \"{etcd}\", engine_path: models/demo}}\n")
    objects = render(config, tmp_path / "manifests")
    deployments = {d["metadata"]["name"]: d for d in of_kind(objects, "Deployment")}
    assert sorted(deployments) == sorted(PODS)

    # the volumes: the ConfigMap's files, and the PVC holding the engine at engine_path
    volumes = tmp_path / "volumes"
    (volumes / "engines" / "models").mkdir(parents=True)
    (volumes / "engines" / "models" / "demo").symlink_to(demo_engine)
    (configmap,) = [c for c in of_kind(objects, "ConfigMap") if c["metadata"]["name"].endswith("-config")]
    pod_spec = deployments["triton-disagg-context"]["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: volumes / m["name"] for m in pod_spec["containers"][0]["volumeMounts"]
              if m["name"] in ("config", "engines")}
    pods_config = yaml.safe_load(configmap["data"]["disagg_config.yaml"])
    assert pods_config["model"]["engine"] == "/engines/models/demo"
    pods_config["model"]["engine"] = mount(pods_config["model"]["engine"], mounts)
    (volumes / "config").mkdir()
    (volumes / "config" / "disagg_config.yaml").write_text(yaml.safe_dump(pods_config))

    with open(tmp_path / "etcd.log", "wb") as log:
        hosts.popen("etcd", etcd_server.command(tmp_path / "etcd-data", hosts.address("etcd"),
                                                ETCD_PORT, ETCD_PORT + 1),
                    stdout=log, stderr=subprocess.STDOUT)
    commands, probes = [], []
    pods = tmp_path / "pods"
    for name, deployment in deployments.items():
        host = PODS[name]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = kubelet_env(container, hosts.address(host))
        argv = [mount(expand(arg, env), mounts) for arg in container["command"]]
        cmd = hosts.command(host, [*(f"{k}={v}" for k, v in env.items()), *servers.cli_argv(argv)])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        grpc = f"{hosts.address(host)}:{PORTS[host]['grpc']}"
        commands.append((cmd, pods / "work" / host, None, grpc, None))
        probes += [f"http://{hosts.address(host)}:{ports[container[kind]['httpGet']['port']]}"
                   f"{container[kind]['httpGet']['path']}"
                   for kind in ("readinessProbe", "livenessProbe", "startupProbe")]

    with servers.serve_commands(commands, cwd=pods):
        metrics = f"http://{hosts.address('scheduler')}:{PORTS['scheduler']['metrics']}/metrics"
        members = lambda: [total(parse_metrics(scrape(hosts, "scheduler", metrics)),  # noqa: E731
                                 "disagg_pool_members", server_role=r)
                           for r in ("context", "generation")]
        servers.wait_until(lambda: members() == [1, 1], 15, "context and generation in etcd")
        for url in probes:           # scrape fails on any answer but 200
            scrape(hosts, "scheduler", url)
        offline = servers.offline_text(demo_engine)
        scheduler = f"{hosts.address('scheduler')}:{PORTS['scheduler']['grpc']}"
        texts = grpc_streams(hosts, "scheduler", scheduler, MAX_TOKENS, servers.PROMPTS)
        assert texts == [offline(p, MAX_TOKENS) for p in servers.PROMPTS]

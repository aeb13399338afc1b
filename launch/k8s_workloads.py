"""The pods of a Kubernetes deployment: one Deployment per unit, the config they read, the
scheduler's Service and the etcd they register in.

A unit is the roles whose servers share a pod: each of context, generation and scheduler
alone, except with ``kv_cache.strategy: host_memory``, where context and generation share
one pod (and its ``/dev/shm``, where the KV cache is staged), one replica of it, since the
scheduler does not pair a context server with the generation server of its own pod.

Every container runs :func:`launch.serve_argv.serve_argv`: bound to ``0.0.0.0`` on the
role's ``PORTS``, with Triton's HTTP and the role's HTTP front open for the probes (readiness
the front's ``/healthz``, liveness and startup ``/metrics`` on the metrics port: the front's
metrics door, forwarding to tritonserver's), context and generation advertising ``$(POD_IP)``, which
the kubelet expands from the downward API, and every server reads the deployment secret
(``TRITON_DISAGG_KV_SECRET``) from the Secret ``kubernetes.kv_secret``, which the user
creates: it signs KV handles and keys the token channel's encryption. When ``discovery``
has TLS or auth, every server (and the in-cluster etcd) mounts the Secret
``kubernetes.etcd_secret`` at ``ETCD_TLS_DIR``: keys ``ca.crt``, ``tls.crt`` / ``tls.key`` (the
client certificate), ``server.crt`` / ``server.key`` (the in-cluster etcd's), ``password``
(read as ``ETCD_PASSWORD_ENV``). Pods read the user's
config as rewritten by :func:`pod_config` from a ConfigMap at ``CONFIG_PATH``, and the
engine from a PVC mounted read-only at ``ENGINES_DIR``.

The server pods run as the images' user (``RUN_AS``, the Dockerfile's ``USER``), never
root, and meet the "restricted" Pod Security Standard: :data:`POD_SECURITY` (non-root,
``fsGroup`` so the etcd Secret's files, mode 0440, are readable, the default seccomp
profile) and :data:`CONTAINER_SECURITY` (no privilege escalation, every capability
dropped). The root filesystem stays writable: serve writes its work directory
(``work/`` under the image's ``/opt/triton-disagg``, owned by that user) and Python and
Triton write temporary files. Without a user namespace or ``CAP_SYS_ADMIN``
tritonserver gets no private ``/dev/shm`` (:mod:`triton_disagg.triton.private_shm`);
the images' ``TRITON_DISAGG_ALLOW_SHARED_SHM=container`` lets it serve on the pod's own
(the ``dshm`` emptyDir), and ``hostIPC`` is never set.

Invariants: ports are distinct across roles (two roles can share a pod) and their names
are ``<short role>-<kind>``; every object carries ``labels(k8s)`` and each Deployment
selects its pods by unit; nothing here depends on which namespace the objects land in.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from triton_disagg.config.disagg import DisaggConfig
from triton_disagg.config.kubernetes import IN_CLUSTER, KubernetesConfig
from triton_disagg.config.roles import Role
from triton_disagg.errors import UserError
from triton_disagg.kv.connector import strategy as kv_strategy
from triton_disagg.kv.secret import SECRET_ENV

from .drain import DRAIN_SECONDS, NOTICE_SECONDS
from .front_process import DEFAULT_FRONT_PORTS
from .serve_argv import serve_argv
from triton_disagg.triton.tritonserver import STOP_GRACE_SECONDS

CONFIG_DIR = "/etc/triton-disagg"
CONFIG_PATH = f"{CONFIG_DIR}/disagg_config.yaml"
ENGINES_DIR = "/engines"
# "front": the role's HTTP front (the scheduler's: the OpenAI API; every role's: /healthz);
# the scheduler's pod alone in its network namespace takes serve all's ports
PORTS = {"scheduler": {"http": 8000, "grpc": 8001, "metrics": 8002,
                       "front": DEFAULT_FRONT_PORTS["all"]},
         "context": {"http": 8010, "grpc": 8011, "metrics": 8012, "front": 8013},
         "generation": {"http": 8020, "grpc": 8021, "metrics": 8022, "front": 8023}}
SHORT = {"scheduler": "sch", "context": "ctx", "generation": "gen"}
# ready: the role's front; live: the metrics port (the front's metrics door, forwarding to
# tritonserver's: both alive), which has no request cap (the public door's HTTP port has one)
READY_PATH, LIVE_PATH = "/healthz", "/metrics"
SHM_BASE = 64 * 2**20        # Triton's Python-backend regions (Docker's default /dev/shm)
ETCD_PORT = 2379
DEFAULT_TTL_SECONDS = 10
ETCD_TLS_DIR = f"{CONFIG_DIR}/etcd"
ETCD_PASSWORD_ENV = "TRITON_DISAGG_ETCD_PASSWORD"
# discovery's file options -> their key in the etcd Secret
ETCD_FILES = {"ca_file": "ca.crt", "cert_file": "tls.crt", "key_file": "tls.key"}
# a stopping server drains (notice + at most DRAIN_SECONDS), then gives tritonserver its
# stop grace, plus a margin: Kubernetes' default of 30 s would cut the drain short
TERMINATION_GRACE_SECONDS = math.ceil(NOTICE_SECONDS + DRAIN_SECONDS + STOP_GRACE_SECONDS) + 5
RUN_AS = 10001                # uid and gid of the images' user (Dockerfile: USER)
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS,
                "fsGroup": RUN_AS, "fsGroupChangePolicy": "OnRootMismatch",
                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
_PLACED = {"url", "urls", "gpus", "cpus", "instances", "http_port", "metrics_port", "front_port"}


@dataclass(frozen=True)
class Unit:
    """One Deployment: ``roles`` run as containers of each of its pods."""

    name: str                       # the component label and the Deployment's name suffix
    roles: tuple[str, ...]
    single: bool = False            # one replica, never autoscaled (host_memory's pair)


def units(config: DisaggConfig) -> tuple[Unit, ...]:
    """The Deployments of ``config`` (module docstring)."""
    if config.grpc_tls is not None:
        raise UserError(f"{config.source}: grpc_tls: launch k8s does not mount certificates "
                        f"into the pods yet; drop grpc_tls here (the NetworkPolicies keep the "
                        f"roles' gRPC inside the deployment) or add the Secret and paths to the "
                        f"manifests yourself")
    if config.aggregated:
        return Unit(Role.GENERATION, (Role.GENERATION,)), Unit(Role.SCHEDULER, (Role.SCHEDULER,))
    if kv_strategy(config.kv_cache.strategy).needs_one_host:
        for role in ("context", "generation"):
            given = config.kubernetes.scaling.get(role)
            if given is not None and given.max_replicas > 1:
                raise UserError(f"{config.source}: kubernetes.{role}.max_replicas: "
                                f"{given.max_replicas}, but "
                                f"with kv_cache.strategy host_memory context and generation "
                                f"share one pod of one replica (the KV cache is staged in its "
                                f"/dev/shm); use direct_transfer to scale them")
        return (Unit("context-generation", ("context", "generation"), single=True),
                Unit("scheduler", ("scheduler",)))
    return tuple(Unit(role, (role,)) for role in ("context", "generation", "scheduler"))


def labels(k8s: KubernetesConfig, unit: Unit | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "triton-disagg", "app.kubernetes.io/instance": k8s.name}
    if unit is not None:
        out["app.kubernetes.io/component"] = unit.name
    return out


def metadata(k8s: KubernetesConfig, name: str, unit: Unit | None = None) -> dict:
    return {"name": name, "labels": labels(k8s, unit)}


def etcd_endpoint(k8s: KubernetesConfig) -> str:
    """host:port the pods register in: the in-cluster etcd's Service, or the external one."""
    return f"{k8s.name}-etcd:{ETCD_PORT}" if k8s.etcd == IN_CLUSTER else k8s.etcd


def pod_config(raw: dict, config: DisaggConfig) -> dict:
    """The user's config (``raw``, as parsed from YAML) as pods read it: the engine at its
    place in the volume; discovery through :func:`etcd_endpoint` (prefix and lease from the
    config's ``discovery``, else ``/triton-disagg/<name>`` and 10 s; its TLS files at their
    place in the etcd Secret's mount, its password from ``ETCD_PASSWORD_ENV``); per role no urls or
    ports (flags give them) and no host cores (``instances`` instead; GPUs renumbered from 0,
    as the device plugin shows them); no ``kubernetes`` section. Everything else as given."""
    k8s = config.kubernetes
    out = {key: value for key, value in raw.items() if key != "kubernetes"}
    out["model"] = {"engine": f"{ENGINES_DIR}/{k8s.engine_path or config.engine.name}",
                    "name": config.served_model_name}
    for role in ("context", "generation"):
        server = config.server(role)
        section = {k: v for k, v in (raw.get(f"{role}_server") or {}).items() if k not in _PLACED}
        section.update({"gpus": list(range(len(server.gpus)))} if server.gpus
                       else {"instances": server.instances})
        out[f"{role}_server"] = section
    out.pop("scheduler_server", None)
    if config.scheduler.instances > 1:
        out["scheduler_server"] = {"instances": config.scheduler.instances}
    found = config.discovery
    out["discovery"] = {"etcd": etcd_endpoint(k8s),
                        "prefix": found.prefix if found else f"/triton-disagg/{k8s.name}",
                        "ttl_seconds": found.ttl_seconds if found else DEFAULT_TTL_SECONDS}
    if found is not None:
        out["discovery"].update({key: f"{ETCD_TLS_DIR}/{name}" for key, name in ETCD_FILES.items()
                                 if getattr(found, key) is not None})
        if found.username is not None:
            out["discovery"].update(username=found.username, password_env=ETCD_PASSWORD_ENV)
    return out


def etcd_secured(config: DisaggConfig) -> bool:
    """Whether discovery uses TLS or auth, so pods mount ``kubernetes.etcd_secret``."""
    found = config.discovery
    return found is not None and (found.tls or found.username is not None)


def _etcd_secret_mount(config: DisaggConfig) -> list[dict]:
    if not etcd_secured(config):
        return []
    return [{"name": "etcd-tls", "mountPath": ETCD_TLS_DIR, "readOnly": True}]


def _etcd_secret_volume(config: DisaggConfig) -> list[dict]:
    if not etcd_secured(config):
        return []
    return [{"name": "etcd-tls", "secret": {"secretName": config.kubernetes.etcd_secret,
                                            "defaultMode": 0o440}}]


def deployment(unit: Unit, config: DisaggConfig, image: str) -> dict:
    k8s = config.kubernetes
    staged = config.kv_cache.max_size * config.context.instances if (
        "context" in unit.roles and kv_strategy(config.kv_cache.strategy).needs_one_host) else 0
    pod = {
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "securityContext": copy.deepcopy(POD_SECURITY),
        "containers": [_container(role, config, image) for role in unit.roles],
        "volumes": [
            {"name": "config", "configMap": {"name": f"{k8s.name}-config"}},
            {"name": "engines", "persistentVolumeClaim": {"claimName": k8s.engine_pvc,
                                                          "readOnly": True}},
            {"name": "dshm", "emptyDir": {"medium": "Memory",
                                          "sizeLimit": f"{(SHM_BASE + staged) // 2**20}Mi"}},
            *_etcd_secret_volume(config),
        ],
    }
    spec = {"selector": {"matchLabels": labels(k8s, unit)},
            "template": {"metadata": {"labels": labels(k8s, unit)}, "spec": pod}}
    if unit.single:
        spec = {"replicas": 1, **spec}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": metadata(k8s, f"{k8s.name}-{unit.name}", unit), "spec": spec}


def _container(role: str, config: DisaggConfig, image: str) -> dict:
    ports, short = PORTS[role], SHORT[role]
    advertise = None if role == Role.SCHEDULER else f"$(POD_IP):{ports['grpc']}"
    # The deployment secret signs KV handles and keys the token channel's CURVE encryption
    # (triton_disagg.zmq_endpoints): every server of the deployment needs the same.
    env = [{"name": SECRET_ENV, "valueFrom": {"secretKeyRef": {
        "name": config.kubernetes.kv_secret, "key": "secret"}}}]
    if role != Role.SCHEDULER:
        env += [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "UCX_TLS", "value": "tcp"}]      # pods of one node share no /dev/shm
    if config.discovery is not None and config.discovery.username is not None:
        env.append({"name": ETCD_PASSWORD_ENV, "valueFrom": {"secretKeyRef": {
            "name": config.kubernetes.etcd_secret, "key": "password"}}})
    metrics, front = f"{short}-metrics", f"{short}-front"
    return {
        "name": role, "image": image,
        "command": serve_argv(role, CONFIG_PATH, "0.0.0.0", ports["grpc"], ports["metrics"],
                              http_port=ports["http"], advertise=advertise,
                              front_port=ports["front"]),
        "env": env,
        "ports": [{"name": f"{short}-{kind}", "containerPort": port, "protocol": "TCP"}
                  for kind, port in ports.items()],
        "readinessProbe": _probe(READY_PATH, front, period=5, failures=2),
        "livenessProbe": _probe(LIVE_PATH, metrics, period=10, failures=3),
        "startupProbe": _probe(LIVE_PATH, metrics, period=5, failures=60),   # 5 min to start
        "resources": _resources(role, config),
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "engines", "mountPath": ENGINES_DIR, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"},
                         *_etcd_secret_mount(config)],
    }


def _probe(path: str, port: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "failureThreshold": failures}


def _resources(role: str, config: DisaggConfig) -> dict:
    """GPUs as ``nvidia.com/gpu`` (requests equal to limits, as extended resources must be),
    else one CPU per pinned core or per model instance."""
    server = config.server(role)
    if server.gpus:
        gpus = {"nvidia.com/gpu": str(len(server.gpus))}
        return {"requests": gpus, "limits": dict(gpus)}
    return {"requests": {"cpu": str(len(server.cpus) or server.instances)}}


def scheduler_service(config: DisaggConfig) -> dict:
    """Clients' entry: HTTP 8000, gRPC 8001, metrics 8002 and the HTTP front 8080, as
    ``serve all`` serves them."""
    k8s = config.kubernetes
    unit = next(u for u in units(config) if "scheduler" in u.roles)
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(k8s, f"{k8s.name}-scheduler", unit),
            "spec": {"selector": labels(k8s, unit),
                     "ports": [{"name": kind, "port": port, "targetPort": f"sch-{kind}",
                                "protocol": "TCP"}
                               for kind, port in PORTS["scheduler"].items()]}}


def etcd_objects(config: DisaggConfig) -> list[dict]:
    """A one-member etcd (StatefulSet and Service) when ``kubernetes.etcd`` is in_cluster.
    Its data is an emptyDir: membership is soft state, every server re-registers under a
    new lease when etcd lost it (triton_disagg.routing.discovery.registration).

    It listens for clients on its pod IP and loopback (for ``etcdctl`` in the pod), never
    0.0.0.0. With discovery's TLS it serves https with the etcd Secret's ``server.crt`` /
    ``server.key``, and with a client certificate configured it demands one signed by
    ``ca.crt`` (``--client-cert-auth``); its readiness probe is then a TCP connect. Auth
    (users, ``auth enable``) is etcd's own state: docs/deploy.md gives the commands.
    It runs as the servers' pods do (``POD_SECURITY``, ``CONTAINER_SECURITY``: non-root,
    no privilege escalation, no capabilities), its data in a directory it makes itself
    (0700) inside the emptyDir, which ``fsGroup`` lets it write."""
    k8s = config.kubernetes
    if k8s.etcd != IN_CLUSTER:
        return []
    found, unit = config.discovery, Unit("etcd", ())
    scheme = "https" if found is not None and found.tls else "http"
    name, peer = f"{k8s.name}-etcd", "http://127.0.0.1:2380"
    command = ["etcd", "--name", "etcd-0", "--data-dir", "/var/lib/etcd/data",
               "--listen-client-urls",
               f"{scheme}://$(POD_IP):{ETCD_PORT},{scheme}://127.0.0.1:{ETCD_PORT}",
               "--advertise-client-urls", f"{scheme}://{name}:{ETCD_PORT}",
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"etcd-0={peer}", "--auto-compaction-retention=1"]
    probe: dict = {"httpGet": {"path": "/health", "port": "client"}}
    if scheme == "https":
        command += ["--cert-file", f"{ETCD_TLS_DIR}/server.crt",
                    "--key-file", f"{ETCD_TLS_DIR}/server.key"]
        probe = {"tcpSocket": {"port": "client"}}
        if found.cert_file is not None:
            command += ["--trusted-ca-file", f"{ETCD_TLS_DIR}/ca.crt", "--client-cert-auth"]
    mounts = [{"name": "data", "mountPath": "/var/lib/etcd"}, *_etcd_secret_mount(config)]
    container = {"name": "etcd", "image": k8s.etcd_image, "command": command,
                 "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {
                     "fieldPath": "status.podIP"}}}],
                 "ports": [{"name": "client", "containerPort": ETCD_PORT, "protocol": "TCP"}],
                 "readinessProbe": {**probe, "periodSeconds": 5},
                 "securityContext": copy.deepcopy(CONTAINER_SECURITY),
                 "volumeMounts": mounts}
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": metadata(k8s, name, unit),
         "spec": {"selector": labels(k8s, unit),
                  "ports": [{"name": "client", "port": ETCD_PORT, "targetPort": "client",
                             "protocol": "TCP"}]}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata(k8s, name, unit),
         "spec": {"serviceName": name, "replicas": 1,
                  "selector": {"matchLabels": labels(k8s, unit)},
                  "template": {"metadata": {"labels": labels(k8s, unit)},
                               "spec": {"securityContext": copy.deepcopy(POD_SECURITY),
                                        "containers": [container],
                                        "volumes": [{"name": "data", "emptyDir": {}},
                                                    *_etcd_secret_volume(config)]}}}},
    ]

"""The Kubernetes objects of a mesh, from the one topology (deploy/topology.yaml) and the
deployment file (deploy/gaas.yaml), built by the same code that renders the local Envoy configs
(gaas.envoy.config) and places the services' settings (gaas.ops.serviceenv).

Per service (control, kvcache, billing, router) and per worker pool (one Deployment per model
version): a ServiceAccount (the pods' identity: the Secret with its certificate is that
Deployment's alone), a ConfigMap with its Envoy sidecar's config, a Deployment whose pods run the
service and its Envoy as a native sidecar (an init container that keeps running), a headless
Service (the Envoys of other pods resolve it to every ready pod), a PodDisruptionBudget, and an
autoscaler: a HorizontalPodAutoscaler on CPU for the services, a KEDA ScaledObject on the
workers' own queue and KV-cache use for the pools. Billing's replicas share one ReadWriteMany
claim for batch files. The ingress (gaas/k8s/edge.py) is an Envoy alone behind a LoadBalancer
Service, serving HTTPS. Every container asks for and is limited in CPU, memory and ephemeral
storage (and every emptyDir has a size limit), so no pod fills its node's disk. NetworkPolicies
(gaas/k8s/policies.py) let only the mesh's pods reach an inbound listener, anyone reach the
ingress, and only Redis's clients reach Redis (and the databases' clients PostgreSQL).
Redis (and for a trial PostgreSQL) are StatefulSets (gaas/k8s/stores.py); a managed PostgreSQL is
named by URL instead.

The objects name Secrets they do not hold (certificates, passwords, database URLs): gaas/k8s/secrets.py
writes those files, outside the checked-in example, and the kustomization makes Secrets of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gaas.contracts.autoscale import AWAITING_METRIC, AutoscalePolicy
from gaas.contracts.device import DeviceRequirement
from gaas.envoy import config as envoyconf
from gaas.envoy.binary import ENVOY_ARGS
from gaas.k8s import pods
# (The module each service's container runs is what `gaas up` uses.)
from gaas.launcher.mesh import SERVICE_MODULES
from gaas.launcher.secrets import REDIS_CLIENTS, SECRETS
from gaas.ops import protogen
from gaas.ops.serviceenv import service_env
from gaas.ops.topology import READY_PATH, Instance, Topology
from gaas.settings import worker as worker_settings
from gaas.settings.env import default_of, variables
from gaas.settings.services import SETTINGS as SERVICE_SETTINGS

if TYPE_CHECKING:
    from gaas.k8s.edge import Edge

SERVICE_IMAGE = "gaas-services"
WORKER_IMAGE = "gaas-worker"
REDIS_IMAGE = "redis:7.4"
POSTGRES_IMAGE = "postgres:17"

# What each container asks for and may use. A worker's memory is its KV cache's plus this.
# Ephemeral storage: its emptyDirs (EMPTY_DIRS) and what it writes outside volumes.
RESOURCES = {
    "control": ({"cpu": "250m", "memory": "512Mi", "ephemeral-storage": "256Mi"},
                {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "4Gi"}),
    "kvcache": ({"cpu": "250m", "memory": "512Mi", "ephemeral-storage": "256Mi"},
                {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "4Gi"}),
    "billing": ({"cpu": "250m", "memory": "512Mi", "ephemeral-storage": "256Mi"},
                {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "4Gi"}),
    "router": ({"cpu": "500m", "memory": "768Mi", "ephemeral-storage": "256Mi"},
               {"cpu": "2", "memory": "2Gi", "ephemeral-storage": "4Gi"}),
    "envoy": ({"cpu": "100m", "memory": "128Mi", "ephemeral-storage": "64Mi"},
              {"cpu": "1", "memory": "512Mi", "ephemeral-storage": "1Gi"}),
    "ingress": ({"cpu": "500m", "memory": "256Mi", "ephemeral-storage": "128Mi"},
                {"cpu": "2", "memory": "1Gi", "ephemeral-storage": "2Gi"}),
    "redis": ({"cpu": "100m", "memory": "256Mi", "ephemeral-storage": "64Mi"},
              {"cpu": "1", "memory": "1536Mi", "ephemeral-storage": "256Mi"}),
    "postgres": ({"cpu": "250m", "memory": "512Mi", "ephemeral-storage": "256Mi"},
                 {"cpu": "2", "memory": "2Gi", "ephemeral-storage": "2Gi"}),
}
WORKER_CPU = "2"
WORKER_MEMORY_EXTRA_GIB = 3
# A worker's ephemeral storage (its /tmp holds the engine's compile caches), asked for and at most.
WORKER_EPHEMERAL = ("2Gi", "16Gi")
# Each emptyDir's size limit (a worker's tmp: WORKER_TMP); sockets are in memory.
EMPTY_DIRS = {"sockets": "16Mi", "tmp": "1Gi", "spool": "1Gi", "logs": "1Gi"}
WORKER_TMP = "12Gi"
# How long a worker's pod may take to start serving (its model loads, its engine warms up).
WORKER_STARTUP_SECONDS = 600
SERVICE_STARTUP_SECONDS = 120
# The user every GaaS container runs as (the images create it).
UID = 10001


def _default_edge() -> Edge:
    from gaas.k8s.edge import Edge  # (gaas/k8s/edge.py builds on this module)

    return Edge()


@dataclass(frozen=True, slots=True)
class Options:
    """What an operator chooses when rendering."""

    # Replicas of each stateless service (router, control, kvcache, billing), the HPA's least.
    replicas: int = 2
    # The most an HPA scales a service to.
    max_replicas: int = 8
    # True: PostgreSQL as a StatefulSet in the cluster (a trial); False: a managed one, its URLs
    # in the services' Secrets.
    postgres: bool = True
    # The most workers KEDA scales a pool of `replicas: auto` to.
    max_workers: int = 4
    # Where KEDA reads the workers' metrics.
    prometheus: str = "http://prometheus-operated.monitoring.svc:9090"
    # How clients reach the ingress: its certificate, plaintext, the load balancers it trusts.
    edge: Edge = field(default_factory=_default_edge)
    # Billing's batch files: one ReadWriteMany claim of this size, of this storage class ("": the
    # cluster's default class, which must then offer ReadWriteMany).
    files_size: str = "50Gi"
    files_storage_class: str = ""




def labels(name: str, component: str) -> dict:
    return {pods.NAME_LABEL: name, pods.COMPONENT_LABEL: component, **pods.PART_OF}


def selector(name: str) -> dict:
    return {pods.NAME_LABEL: name}


def meta(name: str, component: str, **extra) -> dict:
    return {"name": name, "labels": labels(name, component), **extra}


def service_account(name: str, component: str) -> dict:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(name, component),
            "automountServiceAccountToken": False}


def envoy_configmap(name: str, component: str, config: dict) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(f"{name}-envoy", component),
            "data": {pods.ENVOY_FILE.name: envoyconf.config_text(config)}}


def http_probe(port: int, path: str, *, period: int = 10, failures: int = 3, timeout: int = 2) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": timeout}


def security() -> dict:
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def mount(name: str, path, read_only: bool = False) -> dict:
    return {"name": name, "mountPath": str(path), **({"readOnly": True} if read_only else {})}


def envoy_container(name: str, instance: str, resources: tuple[dict, dict], *, sidecar: bool) -> dict:
    """The Envoy of instance (named name) running its config from the pod's ConfigMap; as a native
    sidecar (an init container with restartPolicy Always) it starts before the service and stops
    after it."""
    requests, limits = resources
    c = {
        "name": "envoy",
        "image": SERVICE_IMAGE,
        "command": ["envoy", "-c", str(pods.ENVOY_FILE), *ENVOY_ARGS, "--service-node", name],
        "env": [{"name": "PATH", "value": pods.PATH}, {"name": "GAAS_ENVOY_NAME", "value": name}],
        "ports": [{"name": "envoy-stats", "containerPort": pods.ENVOY_STATS_PORT}],
        "startupProbe": http_probe(pods.ENVOY_STATS_PORT, "/metrics", period=1, failures=30),
        "livenessProbe": http_probe(pods.ENVOY_STATS_PORT, "/metrics"),
        "resources": {"requests": requests, "limits": limits},
        "securityContext": security(),
        "volumeMounts": [mount("envoy", pods.ENVOY_DIR, True), mount("pki", pods.PKI_DIR, True),
                         mount("sockets", pods.sockets_dir(instance)), mount("logs", pods.LOG_DIR)],
    }
    if sidecar:
        c["restartPolicy"] = "Always"
        c["ports"].insert(0, {"name": "mtls", "containerPort": pods.INBOUND_PORT})
    return c


def downward_env() -> list[dict]:
    return [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]


def secret_env_name(name: str) -> str:
    return f"{name}-env"


def secret_keys(kind: str) -> list[str]:
    """The secret variables a service of kind gets (gaas.launcher.secrets.SECRETS, and its own
    Redis user's URL), from its own Secret."""
    keys = [k for k, kinds in SECRETS.items() if kind in kinds]
    if kind in REDIS_CLIENTS:
        keys.append("GAAS_REDIS_URL")
    return keys


def reads_deploy_file(kind: str) -> bool:
    return any(v.field == "deploy_file" for v in variables(SERVICE_SETTINGS[kind]))


def service_container(inst: Instance, startup_seconds: int, resources: tuple[dict, dict]) -> dict:
    env = service_env(inst, pods.placement(inst))
    image = WORKER_IMAGE if inst.service == "worker" else SERVICE_IMAGE
    requests, limits = resources
    c = {
        "name": inst.service,
        "image": image,
        "command": [pods.PYTHON, "-m", SERVICE_MODULES[inst.service]],
        "workingDir": str(pods.APP_DIR),
        "env": [*downward_env(), {"name": "PATH", "value": pods.PATH}, {"name": "HOME", "value": str(pods.TMP_DIR)},
                {"name": "PYTHONUNBUFFERED", "value": "1"},
                *({"name": k, "value": v} for k, v in sorted(env.items()))],
        "ports": [{"name": "metrics", "containerPort": pods.METRICS_PORT}],
        # Started: its /metrics answers (it serves them from its first seconds). Ready: its
        # sidecar's health check of it (gRPC health, SERVING) passes. Alive: /metrics answers.
        "startupProbe": http_probe(pods.METRICS_PORT, "/metrics", period=5, failures=startup_seconds // 5),
        "readinessProbe": http_probe(pods.ENVOY_STATS_PORT, READY_PATH, period=2, failures=2),
        "livenessProbe": http_probe(pods.METRICS_PORT, "/metrics", period=10, failures=6, timeout=5),
        "resources": {"requests": requests, "limits": limits},
        "securityContext": security(),
        "volumeMounts": [mount("sockets", pods.sockets_dir(inst.name)), mount("tmp", pods.TMP_DIR),
                         mount("spool", pods.SPOOL_DIR)],
    }
    if secret_keys(inst.service):
        c["envFrom"] = [{"secretRef": {"name": secret_env_name(inst.name)}}]
    if reads_deploy_file(inst.service):
        c["volumeMounts"].append(mount("deploy", pods.DEPLOY_DIR, True))
    if keeps_files(inst.service):
        c["volumeMounts"].append(mount("files", pods.FILES_DIR))
    return c


def keeps_files(kind: str) -> bool:
    """Whether kind keeps batch files (billing: GAAS_FILES_DIR)."""
    return any(v.field == "files_dir" for v in variables(SERVICE_SETTINGS[kind]))


def pod_volumes(name: str, *, deploy: bool, files: bool = False, tmp: str = EMPTY_DIRS["tmp"]) -> list[dict]:
    """A pod's volumes, each emptyDir of a bounded size (tmp: its /tmp's). files: batch files
    (billing's), the claim every replica shares (files_claim)."""
    vols = [
        {"name": "sockets", "emptyDir": {"medium": "Memory", "sizeLimit": EMPTY_DIRS["sockets"]}},
        {"name": "tmp", "emptyDir": {"sizeLimit": tmp}},
        {"name": "spool", "emptyDir": {"sizeLimit": EMPTY_DIRS["spool"]}},
        {"name": "logs", "emptyDir": {"sizeLimit": EMPTY_DIRS["logs"]}},
        {"name": "envoy", "configMap": {"name": f"{name}-envoy"}},
        {"name": "pki", "secret": {"secretName": f"{name}-tls", "defaultMode": 0o440}},
    ]
    if deploy:
        vols.append({"name": "deploy", "configMap": {"name": f"{pods.PREFIX}-deploy"}})
    if files:
        vols.append({"name": "files", "persistentVolumeClaim": {"claimName": files_claim_name(name)}})
    return vols


def files_claim_name(name: str) -> str:
    return f"{name}-files"


def files_claim(name: str, component: str, opts: Options) -> dict:
    """The volume of batch files that every replica of name mounts at once (ReadWriteMany: NFS, a
    cloud's file service, CephFS) and that outlives any pod. The file store on it writes each
    file under a temporary name, fsyncs and renames it (services/billing/filestore.py), so every
    replica sees whole files only; docs/kubernetes.md says why a volume rather than the ledger."""
    spec: dict = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": opts.files_size}}}
    if opts.files_storage_class:
        spec["storageClassName"] = opts.files_storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": files_claim_name(name), "labels": labels(name, component)}, "spec": spec}


def deployment(name: str, component: str, containers: list[dict], init: list[dict], *, replicas: int,
               grace: int, volumes: list[dict], strategy: dict | None = None, extra_labels: dict | None = None) -> dict:
    pod_labels = {**labels(name, component), pods.MESH_LABEL: "true", **(extra_labels or {})}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(name, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(name)},
            "strategy": strategy or {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": pod_labels,
                             "annotations": {"prometheus.io/scrape": "true",
                                             "prometheus.io/port": str(pods.METRICS_PORT)}},
                "spec": {
                    "serviceAccountName": name,
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": grace,
                    "securityContext": {"fsGroup": UID, "seccompProfile": {"type": "RuntimeDefault"}},
                    "initContainers": init,
                    "containers": containers,
                    "volumes": volumes,
                },
            },
        },
    }


def headless_service(name: str, component: str, ports: list[tuple[str, int]]) -> dict:
    """Resolves to each ready pod's address: the Envoys balance across them and health-check each."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, component),
            "spec": {"clusterIP": "None", "selector": selector(name),
                     "ports": [{"name": n, "port": p, "targetPort": p} for n, p in ports]}}


def pdb(name: str, component: str, spec: dict) -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta(name, component),
            "spec": {**spec, "selector": {"matchLabels": selector(name)}}}


def hpa(name: str, component: str, low: int, high: int) -> dict:
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta(name, component),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": low, "maxReplicas": high,
            "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                "type": "Utilization", "averageUtilization": 70}}}],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
        },
    }


def service_objects(topo: Topology, inst: Instance, opts: Options) -> list[dict]:
    name, kind = inst.name, inst.service
    config = envoyconf.sidecar_config(topo, inst, Path(pods.LOG_DIR), pods.authority(), Path(pods.SOCKETS_DIR))
    grace = int(default_of(SERVICE_SETTINGS[kind], "grace_seconds")) + 5
    deploy = reads_deploy_file(kind)
    dep = deployment(
        name, kind, [service_container(inst, SERVICE_STARTUP_SECONDS, RESOURCES[kind])],
        [envoy_container(f"sidecar-{name}", name, RESOURCES["envoy"], sidecar=True)],
        replicas=opts.replicas, grace=grace, volumes=pod_volumes(name, deploy=deploy, files=keeps_files(kind)),
        extra_labels={f"{pods.PREFIX}.dev/redis-client": "true"} if kind in REDIS_CLIENTS else None,
    )
    if kind in ("control", "billing") and opts.postgres:
        dep["spec"]["template"]["metadata"]["labels"][f"{pods.PREFIX}.dev/postgres-client"] = "true"
    return [
        service_account(name, kind),
        envoy_configmap(name, kind, config),
        *([files_claim(name, kind, opts)] if keeps_files(kind) else []),
        dep,
        headless_service(name, kind, [("mtls", pods.INBOUND_PORT), ("metrics", pods.METRICS_PORT),
                                      ("envoy-stats", pods.ENVOY_STATS_PORT)]),
        pdb(name, kind, {"minAvailable": 1}),
        hpa(name, kind, opts.replicas, max(opts.max_replicas, opts.replicas)),
    ]


def worker_grace_seconds() -> int:
    """How long a worker's pod may take to stop: its drain (the routers stop sending, its streams
    finish: GAAS_RETIRE_GRACE_SECONDS) and its shutdown (GAAS_GRACE_SECONDS)."""
    cls = worker_settings.WorkerSettings
    return int(default_of(cls, "retire_grace_seconds") + default_of(cls, "grace_seconds")) + 10


def gpu_affinity(need: DeviceRequirement) -> dict | None:
    """Node affinity from a pool's device requirement, in NVIDIA GPU feature discovery's labels."""
    terms = []
    if need.gpu_models:
        terms.append({"key": "nvidia.com/gpu.product", "operator": "In", "values": list(need.gpu_models)})
    if need.gpu_memory_gib:
        terms.append({"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": [str(int(need.gpu_memory_gib * 1024) - 1)]})
    if need.compute_capability:
        major = int(need.compute_capability.split(".")[0])
        terms.append({"key": "nvidia.com/gpu.compute.major", "operator": "Gt", "values": [str(major - 1)]})
    if not terms:
        return None
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": terms}]}}}


def worker_replicas(inst: Instance, opts: Options) -> tuple[int, int, int]:
    """(replicas, least, most) of a pool's Deployment: its autoscale bounds, starting at its
    initial_scale (else min, at least one); auto (as many as the load needs on a cluster): one to
    opts.max_workers; else its replicas, fixed."""
    from gaas.settings.deployspec import AUTO

    auto = inst.options.get("autoscale")
    if auto:
        policy = AutoscalePolicy.from_dict(auto)
        return policy.initial, policy.min, policy.max
    r = inst.options.get("replicas", 1)
    if r == AUTO:
        return 1, 1, max(opts.max_workers, 1)
    return int(r), int(r), int(r)


def scaled_object(name: str, model: str, low: int, high: int, auto: dict | None, opts: Options) -> dict:
    """KEDA scales a pool on the mesh's own signals, as the worker reports them (vLLM's metrics on
    its /metrics): requests per worker (running and waiting) and KV-cache use; and from zero on the
    requests the routers hold while no worker of it serves."""
    target_requests = (auto or {}).get("target_requests", 8.0)
    target_kv = (auto or {}).get("target_kv_usage", 0.85)
    selector_ = f'{pods.NAME_LABEL.replace(".", "_").replace("/", "_")}="{name}"'
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": meta(name, "worker"),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicaCount": low, "maxReplicaCount": high,
            "cooldownPeriod": int((auto or {}).get("zero_after_s", 300)),
            "triggers": [
                {"type": "prometheus", "metricType": "AverageValue", "metadata": {
                    "serverAddress": opts.prometheus,
                    "query": f"sum(vllm:num_requests_running{{model_name=\"{model}\"}}"
                             f" + vllm:num_requests_waiting{{model_name=\"{model}\"}})",
                    "threshold": str(target_requests)}},
                {"type": "prometheus", "metricType": "AverageValue", "metadata": {
                    "serverAddress": opts.prometheus,
                    "query": f"avg(vllm:kv_cache_usage_perc{{model_name=\"{model}\", {selector_}}})",
                    "threshold": str(target_kv)}},
                # A pool at zero has no worker to report load: the requests the routers hold for it wake it.
                {"type": "prometheus", "metricType": "AverageValue", "metadata": {
                    "serverAddress": opts.prometheus,
                    "query": f"sum({AWAITING_METRIC}{{model=\"{model}\"}})",
                    "threshold": str(target_requests), "activationThreshold": "0"}},
            ],
        },
    }


def worker_objects(topo: Topology, inst: Instance, opts: Options) -> list[dict]:
    name = inst.name
    config = envoyconf.sidecar_config(topo, inst, Path(pods.LOG_DIR), pods.authority(), Path(pods.SOCKETS_DIR))
    memory = f"{int(inst.options['kv_cache_gib']) + WORKER_MEMORY_EXTRA_GIB}Gi"
    need = DeviceRequirement.parse(dict(inst.options.get("device_needs") or {}) or inst.options.get("device", "any"))
    cpu = str(need.cpu_cores) if need.cpu_cores else WORKER_CPU
    asks, most = ({"cpu": cpu, "memory": memory, "ephemeral-storage": disk} for disk in WORKER_EPHEMERAL)
    container = service_container(inst, WORKER_STARTUP_SECONDS, (asks, most))
    container["env"].append({"name": "GAAS_DEVICE", "value": "cpu"})
    replicas, low, high = worker_replicas(inst, opts)
    dep = deployment(
        name, "worker", [container], [envoy_container(f"sidecar-{name}", name, RESOURCES["envoy"], sidecar=True)],
        replicas=replicas, grace=worker_grace_seconds(), volumes=pod_volumes(name, deploy=False, tmp=WORKER_TMP),
        # A new worker serves before an old one drains; never fewer than the pool's.
        strategy={"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        extra_labels={f"{pods.PREFIX}.dev/redis-client": "true", f"{pods.PREFIX}.dev/model": _label(inst)},
    )
    if need.kind == "gpu":
        dep["metadata"]["annotations"] = {f"{pods.PREFIX}.dev/device": "gpu"}
    affinity = gpu_affinity(need)
    if affinity:
        dep["spec"]["template"]["spec"]["affinity"] = affinity
    out = [service_account(name, "worker"), envoy_configmap(name, "worker", config), dep,
           headless_service(name, "worker", [("mtls", pods.INBOUND_PORT), ("metrics", pods.METRICS_PORT),
                                             ("envoy-stats", pods.ENVOY_STATS_PORT)]),
           pdb(name, "worker", {"maxUnavailable": 1})]
    if high > low:
        out.append(scaled_object(name, str(inst.options["model"]), low, high, inst.options.get("autoscale"), opts))
    return out


def _label(inst: Instance) -> str:
    return pods.dns_label(str(inst.options["model"]))[:63]


def objects(topo: Topology, opts: Options, descriptor: str | None = None) -> list[dict]:
    """Every object of the base, in a stable order. topo: pods.pod_topology's."""
    descriptor = descriptor or str(pods.APP_DIR / protogen.DESCRIPTOR_SET.relative_to(protogen.ROOT))
    out: list[dict] = []
    for inst in topo.instances:
        out += worker_objects(topo, inst, opts) if inst.service == "worker" else service_objects(topo, inst, opts)
    from gaas.k8s import edge, policies, stores

    out += edge.ingress_objects(topo, descriptor, opts.edge, pods.NAMESPACE)
    out += stores.redis_objects()
    if opts.postgres:
        out += stores.postgres_objects()
    out += policies.network_policies(opts)
    return out

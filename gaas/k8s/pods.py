"""Where things are inside a GaaS pod: the image's paths, the mounted volumes, the ports on the pod
network, and the topology of a mesh whose instances are Deployments (Topology.pod). One definition
for the manifests (gaas/k8s/manifests.py) and the rehearsal that runs them (gaas/k8s/rehearsal.py).

Every pod has the same ports: a service listens on a Unix socket in the pod's `sockets` emptyDir,
and only its sidecar's mutual-TLS inbound listener, the service's /metrics and the sidecar's
statistics (with the readiness answer) are on the pod network."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path, PurePosixPath

from gaas.launcher.fleet import PoolSpec
from gaas.ops import pki
from gaas.ops.serviceenv import Placement
from gaas.ops.topology import (
    ENVOY_STATS_OFFSET, INBOUND_OFFSET, METRICS_OFFSET, POD_BIND, SERVICES, Instance, LocalSockets, Topology,
)
from gaas.settings import deployspec

# The project in both images (Containerfile: WORKDIR), its virtual environment first on PATH.
APP_DIR = PurePosixPath("/opt/gaas")
PATH = f"{APP_DIR}/.venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PYTHON = "python"
# Every pod's volumes are mounted under here.
RUN_DIR = PurePosixPath("/run/gaas")
SOCKETS_DIR = RUN_DIR / "sockets"
ENVOY_DIR = RUN_DIR / "envoy"
DEPLOY_DIR = RUN_DIR / "deploy"
LOG_DIR = RUN_DIR / "logs"
SPOOL_DIR = RUN_DIR / "spool"
# Billing's batch files (uploads and outputs): a volume every billing replica shares.
FILES_DIR = RUN_DIR / "files"
# The ingress's own certificate (its kubernetes.io/tls Secret: tls.crt, tls.key).
EDGE_TLS_DIR = RUN_DIR / "edge-tls"
# pki.Authority(RUN_DIR) keeps its certificates in RUN_DIR/pki: the Secret is mounted there.
PKI_DIR = RUN_DIR / pki.PKI_DIR
TMP_DIR = PurePosixPath("/tmp")
DEPLOY_FILE = DEPLOY_DIR / "gaas.yaml"
ENVOY_FILE = ENVOY_DIR / "envoy.yaml"

# Every pod's port block (gaas.ops.topology's offsets): +1 the sidecar's inbound listener (mutual
# TLS), +4 the service's /metrics, +5 the sidecar's statistics and readiness. +0, +2 and +3 (the
# service, the outbound listener, the admin) are Unix sockets.
PORT_BASE = 9000
INBOUND_PORT = PORT_BASE + INBOUND_OFFSET
METRICS_PORT = PORT_BASE + METRICS_OFFSET
ENVOY_STATS_PORT = PORT_BASE + ENVOY_STATS_OFFSET
# The ingress's port: HTTPS (its Service's 443), or plain HTTP (80) when the render is told so.
INGRESS_TLS_PORT = 8443
INGRESS_PORT = 8080
# (The ingress's statistics are on its own pod's PORT_BASE + 5, like every sidecar's.)
REDIS_PORT = 6379
POSTGRES_PORT = 5432

PREFIX = "gaas"
# The namespace the overlays put the mesh in.
NAMESPACE = "gaas"
# The ingress's Deployment; the identity it presents is pki.INGRESS.
INGRESS = f"{PREFIX}-ingress"
REDIS = f"{PREFIX}-redis"
POSTGRES = f"{PREFIX}-postgres"
# Who may call a pod's inbound listener: pods with this label (every pod of the mesh).
MESH_LABEL = f"{PREFIX}.dev/mesh"
COMPONENT_LABEL = "app.kubernetes.io/component"
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
PART_OF = {"app.kubernetes.io/part-of": "gaas"}


def deployment_name(kind: str) -> str:
    """A service's Deployment (and its Service, ServiceAccount and identity): gaas-<kind>."""
    return f"{PREFIX}-{kind}"


def dns_label(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


def pool_name(pool: dict) -> str:
    """A worker pool's Deployment: gaas-worker-<model>-<version>, a DNS label (at most 47
    characters, so its pods' names stay within 63)."""
    name = f"{PREFIX}-worker-{dns_label(str(pool['model']))}-{dns_label(str(pool['version']))}"
    return name[:47].rstrip("-")


def image_path(source: str) -> str:
    """A model's source as a worker container sees it: a directory of the project is under APP_DIR."""
    root = deployspec.PROJECT_ROOT
    path = Path(source)
    if path.is_absolute() and path.is_relative_to(root):
        return str(APP_DIR / path.relative_to(root))
    return source


def pools(spec: deployspec.DeploySpec) -> list[dict]:
    """The deployment's worker pools, one Deployment each: a worker instance's pool options (their
    sources as the image has them), with the pool's replicas and autoscale bounds."""
    out = []
    for m in spec.models:
        p = PoolSpec.from_model(m)
        out.append({**replace(p, source=image_path(p.source)).options(), "replicas": m.replicas,
                    "autoscale": m.autoscale.as_dict() if m.autoscale else None})
    return out


def pod_topology(topo: Topology, spec: deployspec.DeploySpec) -> Topology:
    """topo (deploy/topology.yaml) as Deployments: one instance per service, named and addressed
    by its Deployment (and headless Service), and one per worker pool; every one on the pod's
    port block."""
    instances = [Instance(kind, deployment_name(kind), 0, deployment_name(kind), PORT_BASE)
                 for kind in SERVICES if kind != "worker"]
    for index, pool in enumerate(pools(spec)):
        options = topo.worker(0, pool).options
        instances.append(Instance("worker", pool_name(pool), index, pool_name(pool), PORT_BASE, options))
    return replace(topo, host=INGRESS, port_base=PORT_BASE, ingress_port=INGRESS_PORT, instances=tuple(instances),
                   pod=True, ingress_replicas=1)


def sockets_dir(inst_name: str) -> PurePosixPath:
    """Where a pod's sockets volume is mounted: the directory of its instance's Unix sockets (the
    service's, the sidecar's outbound and admin: LocalSockets), which so exists before either starts."""
    return PurePosixPath(LocalSockets.of(Path(SOCKETS_DIR), inst_name).dir)


def placement(inst: Instance) -> Placement:
    """Where a service container is (gaas.ops.serviceenv): its pod's name and address come from the
    downward API ($(POD_NAME), $(POD_IP): Kubernetes expands them in env values)."""
    local = LocalSockets.of(Path(SOCKETS_DIR), inst.name)
    return Placement(instance="$(POD_NAME)", host=POD_BIND, advertise=f"$(POD_IP):{INBOUND_PORT}",
                     listen=f"unix:{local.service}", outbound=f"unix:{local.outbound}",
                     spool_dir=str(SPOOL_DIR), deploy_file=str(DEPLOY_FILE), files_dir=str(FILES_DIR))


def authority() -> pki.Authority:
    """The certificates' paths as pods mount them (each pod's Secret holds only its own)."""
    return pki.Authority(Path(RUN_DIR))


def identity(inst: Instance) -> tuple[str, str]:
    """The identity (kind, name) a Deployment's pods present: one per Deployment (and its
    ServiceAccount); a worker pool's lets its pods register under their own names and addresses
    (gaas.contracts.identity.Caller.may_register)."""
    return inst.service, inst.name

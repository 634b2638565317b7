"""The settings the mesh decides for a service instance (where it listens, whom it reaches, what
it serves), as its settings class (gaas.settings) reads them: one definition for `gaas up`
(gaas/launcher/mesh.py) and the Kubernetes manifests (gaas/k8s), which differ only in the
values they place there (a run directory's sockets and files, or a pod's mounted volumes)."""

from __future__ import annotations

from dataclasses import dataclass

from gaas.ops.topology import Instance
from gaas.settings import worker as worker_settings
from gaas.settings.env import env_of, variables
from gaas.settings.services import SETTINGS as SERVICE_SETTINGS


@dataclass(frozen=True, slots=True)
class Placement:
    """Where an instance runs: its name, the address it listens on for /metrics, the sidecar
    address it advertises, its two Unix sockets, its spool, the deployment file and (billing) its batch files."""

    instance: str
    host: str
    advertise: str
    listen: str
    outbound: str
    spool_dir: str
    deploy_file: str
    # Where billing keeps batch files.
    files_dir: str = ""


def placed_values(inst: Instance, where: Placement) -> dict[str, object]:
    """Settings fields of inst's service -> values: where it is in the mesh (each service gets
    those of these it has) and, for a worker, the pool it serves and its engine settings."""
    has = {v.field for v in variables(SERVICE_SETTINGS[inst.service])}
    placed = {
        "instance": where.instance,
        "host": where.host,
        "port": inst.port,
        "metrics_port": inst.metrics_port,
        "advertise": where.advertise,
        "listen": where.listen,
        "outbound": where.outbound,
        "spool_dir": where.spool_dir,
        "deploy_file": where.deploy_file,
        "files_dir": where.files_dir,
    }
    values = {k: v for k, v in placed.items() if k in has}
    if inst.service == "worker":
        o = inst.options
        values.update(model=str(o["model"]), model_path=str(o["source"]), model_version=str(o["version"]),
                      max_model_len=int(o["max_model_len"]), **worker_settings.from_topology(o))
    return values


def service_env(inst: Instance, where: Placement, **more: object) -> dict[str, str]:
    """The environment variables of placed_values (and more settings fields) for inst's service."""
    return env_of(SERVICE_SETTINGS[inst.service], **placed_values(inst, where), **more)

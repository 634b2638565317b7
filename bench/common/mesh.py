"""The mesh a benchmark runs against: `gaas up`'s machinery in a fresh run directory, on a free
block of ports, with its own Redis, from the project's deploy/ files; started, stopped, and the tenants
and keys a benchmark sends with."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from bench.common.output import ROOT


def bench_mesh(
    name: str, port_start: int, progress: Callable[[str], None], *, workers: int = 1,
    replicas: Mapping[str, int] | None = None, worker_options: Mapping[str, object] | None = None,
    deploy_file: Path | None = None, extra_env: Mapping[str, str] | None = None, ingress_path: str | None = None,
    serve_model: str | None = None,
):
    """A gaas.launcher.mesh.Mesh, not yet started, in a new run directory (gaas-<name>-...): deploy/topology.yaml
    with `workers` workers (of each served model: the deployment's replicas: auto), other services'
    replicas as given, the workers' engine options as given, the ingress's path to the workers as
    given (router or direct; default: the topology's); serve_model: that model of the deployment
    served alone (gaas up --model).
    The run directory becomes GAAS_HOME, so in-process admin calls (gaas.sdk.admin, gaas.ops.probe) reach
    the sidecars as this mesh's operator."""
    import yaml

    from gaas.ops import topology
    from gaas.launcher.mesh import Mesh
    from gaas.launcher.rundir import free_port_base

    run_dir = Path(tempfile.mkdtemp(prefix=f"gaas-{name}-"))
    os.environ["GAAS_HOME"] = str(run_dir)
    base = free_port_base(span=200, start=port_start)
    topo_file = ROOT / "deploy" / "topology.yaml"
    if replicas:
        doc = yaml.safe_load(topo_file.read_text())
        for kind, n in replicas.items():
            doc["services"][kind]["replicas"] = n
        topo_file = run_dir / "topology.yaml"
        topo_file.write_text(yaml.safe_dump(doc))
    topo = topology.load(topo_file, env={}, port_base=base, ingress_port=base + 190, workers=workers,
                         ingress_path=ingress_path)
    if worker_options:
        topo = topology.with_worker_options(topo, **worker_options)
    return Mesh(topo, run_dir=run_dir, deploy_file=deploy_file or ROOT / "deploy" / "gaas.yaml",
                redis_url=f"redis://127.0.0.1:{base + 191}/0", progress=progress, extra_env=dict(extra_env or {}),
                serve_model=serve_model, topology_file=topo_file)


@contextmanager
def running(mesh, ready_s: float, *, keep: bool = False, supervise: bool = False) -> Iterator:
    """The mesh started and serving (within ready_s seconds); stopped when the block ends, however it
    ends, and its run directory removed unless keep (its logs kept for a look). supervise: what `gaas
    up` does each second meanwhile (restarts, the workers kept matching the deployment's pools), in a
    thread that outlives every child it starts (a child gets SIGTERM when the thread that started it ends)."""
    import threading

    done = threading.Event()

    def supervising() -> None:
        while not done.wait(1.0):
            mesh.supervise(mesh.progress)

    supervisor = threading.Thread(target=supervising, name="supervise", daemon=True)
    try:
        mesh.start()
        mesh.wait_ready(ready_s)
        if supervise:
            supervisor.start()
        yield mesh
    finally:
        mesh.stop()
        done.set()
        if supervisor.is_alive():
            supervisor.join(timeout=5)
        if keep:
            mesh.progress(f"logs kept in {mesh.run_dir / 'logs'}")
        else:
            shutil.rmtree(mesh.run_dir, ignore_errors=True)


def admin(mesh):
    """A gaas.sdk.admin.Admin on the mesh's control plane (a context manager), as its operator."""
    from gaas.sdk.admin import Admin

    return Admin(mesh.topo.of("control")[0].inbound)


def demo_key(mesh) -> str:
    """The API key of the mesh's demo tenant (made on first use, as `gaas up` does)."""
    with admin(mesh) as a:
        return a.ensure_demo_key(mesh.run_dir)[0]


def tenant_key(a, tenant: str, tier: str, *, rpm: int = 0, tpm: int = 0, concurrency: int = 0) -> str:
    """A new tenant of the tier, with these quotas (0: unlimited, the default: a benchmark measures the
    mesh, not its limits), and an API key of its; the key."""
    a.create_tenant(tenant, tier)
    a.update_tenant(tenant, limits={"rpm": rpm, "tpm": tpm, "concurrency": concurrency})
    return a.create_key(tenant)[1]


def tiny_deployment(*lines: str, after: str = "") -> str:
    """A deployment file serving gaas-tiny alone (the local model, built when missing), its entry
    ending with lines (its workers: "replicas: auto", "autoscale: {...}", "engine: {...}"), and
    after it the file's other sections (after)."""
    entry = "".join(f"    {line}\n" for line in lines)
    return ("models:\n  - name: gaas-tiny\n    version: \"1.0.0\"\n    source: models/gaas-tiny\n    preset: tiny\n"
            f"    max_model_len: 2048\n    default: true\n{entry}{after}")

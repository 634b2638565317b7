"""The mesh the scorecard measures: its own (started from deploy/'s files with the models every
dimension needs, stopped at the end) or a running one (`--target RUN_DIR`, a `gaas up`'s run
directory, reached as its operator). What a dimension asks of it: the ingress, tenants and keys of
its own, the workers' load reports, each router's flow control and metrics, the KV directory's
figures; and, on the scorecard's own mesh only, a router restarted with other settings (a policy, a
loop off), which a mesh someone else runs never is."""

from __future__ import annotations

import os
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.common.mesh import bench_mesh, running

# The scorecard's own mesh: deploy/gaas.yaml (its tiers, prices, sessions) serving two workers of
# gaas-tiny (routing compares them) with a KV cache small enough that the churn workload fills it
# (256 blocks of 32 tokens), and one of gaas-long (32K context).
TINY_KV_BLOCKS = 256
OWN_MODELS = [
    {"name": "gaas-tiny", "version": "1.0.0", "source": "models/gaas-tiny", "preset": "tiny", "max_model_len": 2048,
     "default": True, "replicas": 2, "engine": {"kv_cache_blocks": TINY_KV_BLOCKS}},
    {"name": "gaas-long", "version": "1.0.0", "source": "models/gaas-long", "preset": "long",
     "max_model_len": 32768, "replicas": 1},
]


def own_deployment() -> str:
    import yaml

    from bench.common.output import ROOT

    doc = yaml.safe_load((ROOT / "deploy" / "gaas.yaml").read_text())
    doc["models"] = OWN_MODELS
    return yaml.safe_dump(doc, sort_keys=False)


class OwnMeshOnly(Exception):
    """What a dimension asked needs the scorecard's own mesh (a router restarted with other settings)."""


@dataclass
class Target:
    topo: object
    run_dir: Path
    own: bool
    mesh: object = None
    # Tenants this run made (named so that a second run on the same target makes new ones).
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    _probe_key: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.topo.ingress}"

    def admin(self):
        from gaas.sdk.admin import Admin

        return Admin(self.topo.of("control")[0].inbound, self.run_dir)

    def tenant(self, name: str, tier: str) -> tuple[str, str]:
        """A new tenant of the tier with no quotas (the scorecard measures the mesh, not its limits)
        and an API key of its: (name, key)."""
        tenant = f"sits-{self.run_id}-{name}"
        with self.admin() as a:
            a.create_tenant(tenant, tier)
            a.update_tenant(tenant, limits={"rpm": 0, "tpm": 0, "concurrency": 0})
            return tenant, a.create_key(tenant)[1]

    def key_of(self, tenant: str) -> str:
        """Another API key of a tenant this run made."""
        with self.admin() as a:
            return a.create_key(tenant)[1]

    def workers(self, model: str = "") -> list[dict]:
        from gaas.ops import probe

        ws = probe.list_workers(self.topo.of("control")[0].inbound, timeout=2.0, run_dir=self.run_dir)
        return [w for w in ws if not model or w["model"] == model]

    def models(self) -> list[dict]:
        with self.admin() as a:
            return a.models()

    def flows(self) -> list[dict]:
        """Each router's flow control now (its queue by band, each worker's batching window)."""
        from gaas.sdk.admin import router_flow

        return [f for r in self.topo.of("router") if (f := router_flow(r.inbound)) is not None]

    def kv_stats(self) -> dict | None:
        from gaas.ops import probe

        kvs = self.topo.of("kvcache")
        return probe.kv_stats(kvs[0].inbound, timeout=2.0, run_dir=self.run_dir) if kvs else None

    def router_metrics(self) -> dict[str, list[tuple[dict, float]]]:
        """Every router's Prometheus samples summed by (name, labels): name -> [(labels, value)]."""
        from prometheus_client.parser import text_string_to_metric_families

        merged: dict[tuple[str, tuple], float] = {}
        for r in self.topo.of("router"):
            try:
                with urllib.request.urlopen(f"http://{r.host}:{r.metrics_port}/metrics", timeout=3) as resp:
                    text = resp.read().decode()
            except OSError:
                continue
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    k = (s.name, tuple(sorted(s.labels.items())))
                    merged[k] = merged.get(k, 0.0) + s.value
        out: dict[str, list[tuple[dict, float]]] = {}
        for (name, labels), value in merged.items():
            out.setdefault(name, []).append((dict(labels), value))
        return out

    def ttft_target_ms(self, tier: str) -> float:
        """The tier's TTFT target: the deployment's (a target's: deploy/gaas.yaml's, what `gaas up` applies
        unless told otherwise)."""
        from bench.common.output import ROOT
        from gaas.settings.deployspec import load

        spec = self.mesh.spec if self.mesh is not None else load(ROOT / "deploy" / "gaas.yaml")
        return float(spec.policy(tier).ttft_target_ms)

    @contextmanager
    def routers_with(self, env: Mapping[str, str]) -> Iterator[None]:
        """Every router restarted with these settings for the block, then as it was (OwnMeshOnly on a
        target: a router reads its settings when it starts, and a mesh someone else runs is not
        restarted by a benchmark)."""
        if not self.own:
            raise OwnMeshOnly("a router's settings are read when it starts; the scorecard restarts routers "
                              "only on its own mesh (run `gaas bench sits` without --target)")
        routers = [r.name for r in self.topo.of("router")]
        before = {name: {k: next(c for c in self.mesh.children if c.name == name).env.get(k) for k in env}
                  for name in routers}
        try:
            for name in routers:
                self.mesh.restart(name, env)
            self.wait_served()
            yield
        finally:
            for name in routers:
                self.mesh.restart(name, before[name])
            self.wait_served()

    def wait_served(self, timeout: float = 60.0) -> None:
        """Until a request is served end to end (a router just restarted answers its health check
        before its first call to control has checked a key: a moment of 503s a client would retry)."""
        import httpx

        if self._probe_key is None:
            self._probe_key = self.tenant("probe", "gold")[1]
        body = {"model": self.models()[0]["name"], "prompt": "ready?", "max_tokens": 1}
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.base_url, timeout=30) as c:
            while True:
                try:
                    r = c.post("/v1/completions", json=body, headers={"authorization": f"Bearer {self._probe_key}"})
                    if r.status_code == 200:
                        return
                    why = f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as exc:
                    why = f"{type(exc).__name__}: {exc}"
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the mesh serves no request {timeout:.0f} s after its routers "
                                       f"restarted ({why})")
                time.sleep(0.25)


@contextmanager
def own_target(say: Callable[[str], None], ready_s: float = 600.0, keep_logs: bool = False) -> Iterator[Target]:
    """The scorecard's own mesh, serving, and stopped when the block ends."""
    import tempfile

    deploy = Path(tempfile.mkdtemp(prefix="gaas-sits-deploy-")) / "sits.yaml"
    deploy.write_text(own_deployment())
    mesh = bench_mesh("sits", 25000, say, deploy_file=deploy)
    say(f"starting the scorecard's mesh: 2 workers of gaas-tiny, 1 of gaas-long (logs in {mesh.run_dir / 'logs'})")
    started = time.monotonic()
    with running(mesh, ready_s, keep=keep_logs):
        say(f"mesh ready in {time.monotonic() - started:.0f} s")
        yield Target(mesh.topo, mesh.run_dir, own=True, mesh=mesh)


@contextmanager
def running_target(run_dir: Path) -> Iterator[Target]:
    """A mesh `gaas up` runs from run_dir, reached as its operator (its run directory's certificates)."""
    from types import SimpleNamespace

    from gaas.cli.common import DEFAULT_TOPOLOGY, mesh_state, mesh_topology

    run_dir = run_dir.resolve()
    state = mesh_state(run_dir)
    if state is None:
        raise SystemExit(f"sits: no mesh is running from {run_dir} (`gaas status --run-dir {run_dir}`); start one with "
                         f"`gaas up --run-dir {run_dir}`, or leave --target out to measure the scorecard's own mesh")
    if state.get("ingress_tls_cert"):
        raise SystemExit(f"sits: the mesh running from {run_dir} serves its ingress over TLS (gaas up --tls-cert); the "
                         "scorecard's clients speak plain HTTP: measure a mesh started without --tls-cert")
    os.environ["GAAS_HOME"] = str(run_dir)
    topo = mesh_topology(SimpleNamespace(topology=str(DEFAULT_TOPOLOGY)), state)
    yield Target(topo, run_dir, own=False)

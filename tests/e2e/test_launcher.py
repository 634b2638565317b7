"""What `gaas up` hands each process (gaas/launcher/mesh.py): every secret only to the service that needs
it, a Redis user of its own to each service that uses Redis, nothing of either to an Envoy or the
Redis it starts; and the limits it raises for them."""

from __future__ import annotations

import os

import pytest

from gaas.launcher.fleet import PoolSpec
from gaas.ops import redisacl, topology
from tests.conftest import ROOT

SECRETS = {
    "GAAS_STRIPE_API_KEY": "sk_test_secret",
    "GAAS_DATABASE_URL": "postgresql://control:pw@db/control",
    "GAAS_BILLING_DATABASE_URL": "postgresql://billing:pw@db/billing",
    "GAAS_REDIS_URL": "redis://:operator-pw@127.0.0.1:6379/0",
    "GAAS_API_KEY": "gaas_the_operators_own",
}


@pytest.fixture
def mesh(tmp_path, monkeypatch):
    from gaas.launcher import mesh as mesh_mod

    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(mesh_mod, "visible_gpus", lambda: [])
    t = topology.load(ROOT / "deploy" / "topology.yaml", env={}, port_base=47000, workers=1)
    m = mesh_mod.Mesh(t, run_dir=tmp_path, deploy_file=ROOT / "deploy" / "gaas.yaml",
                      redis_url="redis://:operator-pw@127.0.0.1:6379/0")
    m.redis_users = redisacl.users()  # as when gaas up starts its own Redis
    # Its worker, as the deployment's pool (gaas-tiny, replicas auto) would start it.
    pool = PoolSpec.from_model(m.spec.default_model)
    m.topo = topology.with_workers(m.topo, [m.topo.worker(0, pool.options())])
    return m


def test_each_secret_reaches_only_the_service_that_needs_it(mesh):
    env = {inst.service: mesh.service_env(inst) for inst in mesh.topo.instances}
    holders = {name: sorted(s for s, e in env.items() if e.get(name) == value) for name, value in SECRETS.items()}
    assert holders == {"GAAS_STRIPE_API_KEY": ["billing"], "GAAS_DATABASE_URL": ["control"],
                       "GAAS_BILLING_DATABASE_URL": ["billing"], "GAAS_REDIS_URL": [], "GAAS_API_KEY": []}


def test_each_service_that_uses_redis_is_its_own_user_and_the_others_get_no_redis(mesh):
    for inst in mesh.topo.instances:
        url = mesh.service_env(inst).get("GAAS_REDIS_URL")
        if inst.service in ("control", "router", "worker", "billing"):
            assert url.startswith(f"redis://gaas-{inst.service}:") and "operator-pw" not in url
        else:
            assert url is None, inst.service


def test_an_envoy_and_redis_get_no_secret_and_little_else(mesh, monkeypatch):
    spawned = {}
    monkeypatch.setattr(mesh, "_spawn", lambda name, kind, cmd, env, cpus=None: spawned.setdefault(name, env))
    mesh._spawn_envoy("ingress-0", ROOT / "x.yaml")
    env = spawned["ingress-0"]
    assert not [k for k in env if k.startswith("GAAS_") and k != "GAAS_ENVOY_NAME"], env
    assert not set(SECRETS.values()) & set(env.values())


def test_each_service_gets_settings_it_reads_and_reads_back_what_the_mesh_decided(mesh):
    from gaas.settings.env import variables
    from gaas.settings.services import SETTINGS

    for inst in mesh.topo.instances:
        env = mesh.service_env(inst)
        reads = {v.name for v in variables(SETTINGS[inst.service])}
        # What the launcher wrote (the operator's own variables pass through as they are).
        written = {k for k, v in env.items() if k.startswith("GAAS_") and os.environ.get(k) != v}
        assert written <= reads, (inst.name, written - reads)
        s = SETTINGS[inst.service].from_env(env)
        assert (s.instance, s.port, s.metrics_port) == (inst.name, inst.port, inst.metrics_port)
        assert s.listen.startswith("unix:") and s.listen.endswith(f"/{inst.name}/service.sock")
    worker = mesh.topo.of("worker")[0]
    s = SETTINGS["worker"].from_env(mesh.service_env(worker))
    assert s.advertise == worker.inbound and s.device == "cpu"
    assert {k: getattr(s, k) for k in ("block_size", "kv_cache_gib", "max_num_seqs", "executor")} == {
        k: worker.options[k] for k in ("block_size", "kv_cache_gib", "max_num_seqs", "executor")}
    assert s.enforce_eager is (None if worker.options["enforce_eager"] == "auto" else worker.options["enforce_eager"])

"""KV-aware routing through the real mesh: the engines' own KV events reach the directory, the
router's hashes agree with the directory's (every provision is confirmed by an engine), a repeated
long prompt lands where it is cached while the other worker idles, and tenants never score on each
other's blocks."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.meshutil import gaas, generate, wait_workers_idle, worker_addresses
from tests.waiting import eventually

pytestmark = pytest.mark.mesh

MODEL = "gaas-tiny"


def kv_stats(mesh) -> dict:
    r = gaas(mesh, "kv", "stats", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_directory_watches_every_worker(mesh):
    eventually(lambda: {w["worker_id"] for w in kv_stats(mesh)["per_worker"]} == set(worker_addresses(mesh)), 20,
               every=0.5, what=lambda: f"the directory watching every worker (it watches {kv_stats(mesh)['per_worker']})")


def test_a_repeated_long_prompt_lands_where_it_is_cached_and_the_hashes_agree(mesh):
    prompt = "A prompt long enough to fill many KV blocks, sent again and again by one tenant. " * 16
    wait_workers_idle(mesh)
    finals = [generate(mesh, prompt=prompt, max_tokens=2)[-1] for _ in range(6)]
    holder = finals[0].worker_id
    assert all(f.worker_id == holder for f in finals), [f.worker_id for f in finals]
    full_blocks = finals[0].usage.prompt_tokens // 32
    assert all(f.usage.cached_tokens >= (full_blocks - 1) * 32 for f in finals[1:])
    def confirmed() -> dict | None:
        s = kv_stats(mesh)
        held = {w["worker_id"]: int(w["blocks"]) for w in s["per_worker"]}
        return s if held.get(holder, 0) >= full_blocks and int(s["provision_confirmed"]) >= full_blocks else None

    s = eventually(confirmed, 10, every=0.3, what=lambda: f"{holder} holding the prompt's {full_blocks} blocks, "
                                                          f"confirmed: {kv_stats(mesh)}")
    # The engines confirmed what the router provisioned: the two sides hash alike.
    assert int(s["provision_expired"]) == 0 and int(s["unchained_blocks"]) == 0 and int(s["wrong_size_blocks"]) == 0
    assert s["hit_ratio"] > 0


def test_each_router_follows_the_directory_and_looks_prompts_up_in_its_own_replica(mesh):
    import re
    import urllib.request

    from gaas.ops import topology
    from tests.conftest import MESH_WORKERS, ROOT

    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={}, port_base=mesh.port_base, workers=MESH_WORKERS)
    router = topo.instance("router-0")
    generate(mesh, prompt="Followed by every router, block after block after block after block. " * 8, max_tokens=1)

    def metric(name: str) -> float:
        body = urllib.request.urlopen(f"http://{router.host}:{router.metrics_port}/metrics", timeout=5).read().decode()
        found = re.search(rf"^{name} (\S+)$", body, re.M)
        return float(found.group(1)) if found else 0.0

    # The engines' events reached the router's replica (each change's age recorded), and placements
    # were looked up there.
    eventually(lambda: metric("gaas_router_kv_replica_staleness_seconds_count") > 0, 20, every=0.3,
               what="a change of the directory reaching the router's replica")
    assert metric("gaas_router_kv_lookup_seconds_count") > 0


def test_other_tenants_never_score_on_a_tenants_blocks(mesh):
    keys = {}
    suffix = str(time.time_ns() % 10**8)
    names = {"kvacme": f"kvacme{suffix}", "kvbeta": f"kvbeta{suffix}"}
    for name, tenant in names.items():
        assert gaas(mesh, "tenant", "create", tenant, "--tier", "gold").returncode == 0
        keys[name] = json.loads(gaas(mesh, "key", "create", tenant, "--json").stdout)["api_key"]
    prompt = f"Only kvacme {suffix} sends this, block after block after block after block after block. " * 10

    def send(name):
        c = openai.OpenAI(base_url=f"http://{mesh.ingress}/v1", api_key=keys[name], max_retries=0)
        return c.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage.prompt_tokens_details.cached_tokens

    send("kvacme")
    assert send("kvacme") >= 32
    assert send("kvbeta") == 0, "kvbeta's identical prompt does not touch kvacme's blocks"
    assert send("kvbeta") >= 32, "(its own, it does)"
    per_tenant = {t["tenant"]: int(t["blocks"]) for t in kv_stats(mesh)["per_tenant"]}
    assert per_tenant.get(names["kvacme"], 0) > 0 and per_tenant.get(names["kvbeta"], 0) > 0


def test_status_shows_each_workers_load_and_cached_blocks(mesh):
    status = json.loads(gaas(mesh, "status", "--json").stdout)
    for w in status["workers"]:
        assert {"running", "waiting", "kv_cache_usage", "kv_cache_blocks"} <= set(w["load"])
        assert w["load"]["kv_cache_blocks"] > 0 and w["load"]["reported_unix_ms"] > 0
        assert "cached_blocks" in w
    human = gaas(mesh, "kv", "stats")
    assert human.returncode == 0 and "hit ratio" in human.stdout


def test_a_public_system_prompt_is_shared_across_tenants(mesh):
    system = "You are the shared assistant of every tenant of this mesh, patient and precise. " * 10
    r = gaas(mesh, "kv", "public", "add", MODEL, "--text", system, "--json")
    assert r.returncode == 0, r.stderr
    prefix = json.loads(r.stdout)
    try:
        listed = json.loads(gaas(mesh, "kv", "public", "list", "--json").stdout)
        assert prefix["prefix_id"] in {p["prefix_id"] for p in listed}
        time.sleep(1.5)  # routers refresh their view twice a second
        suffix = str(time.time_ns() % 10**8)
        clients = {}
        for name in ("puba", "pubb"):
            tenant = f"{name}{suffix}"
            assert gaas(mesh, "tenant", "create", tenant).returncode == 0
            key = json.loads(gaas(mesh, "key", "create", tenant, "--json").stdout)["api_key"]
            clients[name] = openai.OpenAI(base_url=f"http://{mesh.ingress}/v1", api_key=key, max_retries=0)

        def cached(name, system_prompt, user):
            usage = clients[name].chat.completions.create(
                model=MODEL, max_tokens=1,
                messages=[{"role": "system", "content": system_prompt}, {"role": "user", "content": user}],
            ).usage
            return usage.prompt_tokens_details.cached_tokens

        assert cached("puba", system, "first question from a") == 0
        assert cached("pubb", system, "another question from b") >= 64, "b reuses the public system prompt"
        private = "A private system prompt that only these tenants use, long enough for blocks. " * 10
        assert cached("puba", private, "question") == 0
        assert cached("pubb", private, "question") == 0, "a prompt not marked public stays per tenant"
    finally:
        assert gaas(mesh, "kv", "public", "remove", prefix["prefix_id"]).returncode == 0

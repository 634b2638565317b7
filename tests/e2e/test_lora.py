"""LoRA adapters at run time on a live mesh of its own (gaas-tiny on two workers whose engines serve
adapters, bench.lora's deployment), through the ingress with the official client: an adapter the
tests build (PEFT format, on the tiny model) is added with `gaas lora add`, served on its first
request by a worker that loads it, kept to that worker by the affinity scorer, metered under its
name, refused to other tenants as an unknown model, refused at `gaas lora add` when it does not
fit, and unloaded when removed."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from bench.common.mesh import tiny_deployment
from bench.lora import build, deployment
from gaas.ops import pki
from gaas.sdk.admin import BillingAdmin
from gaas.v1 import control_pb2, control_pb2_grpc
from tests.conftest import INGRESS_PATH, on_direct_path
from tests.e2e.support import client, instance, new_tenant
from tests.meshutil import gaas, own_mesh
from tests.waiting import eventually

pytestmark = [pytest.mark.mesh]
MODEL = "gaas-tiny"
ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "models" / MODEL


@pytest.fixture(scope="module")
def lmesh(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora-mesh")
    deploy = run_dir / "deploy.yaml"
    deploy.write_text(deployment())
    with own_mesh(run_dir, port_start=26000, workers=2, ingress_path=INGRESS_PATH, args=("--deploy", str(deploy))) as m:
        yield m


@pytest.fixture(scope="module")
def adapters(lmesh, tmp_path_factory):
    """Adapters built for the tiny model: two of rank 8, one of rank 32 (over the pool's 16), and
    one made for a model twice as wide."""
    d = tmp_path_factory.mktemp("adapters")
    wide = d / "wide-base"
    wide.mkdir()
    config = json.loads((BASE / "config.json").read_text())
    config.update(hidden_size=2 * config["hidden_size"], num_attention_heads=2 * config["num_attention_heads"])
    (wide / "config.json").write_text(json.dumps(config))
    return {"a": build(BASE, d / "a", seed=1), "b": build(BASE, d / "b", seed=2),
            "r32": build(BASE, d / "r32", seed=3, rank=32), "wide": build(wide, d / "wide", seed=4)}


def add(m, name: str, path: Path, *args: str):
    return gaas(m, "lora", "add", name, MODEL, str(path), *args)


def holders(m, name: str) -> list[str]:
    """The workers whose engine holds adapter name, as their load reports say."""
    with pki.operator_channel(instance(m, "control-0"), m.run_dir) as ch:
        workers = control_pb2_grpc.ControlStub(ch).ListWorkers(control_pb2.ListWorkersRequest(), timeout=2).workers
    return sorted(w.worker_id for w in workers if name in w.load.adapters)


def complete(c: openai.OpenAI, model: str, n: int = 12):
    return c.completions.create(model=model, prompt="The adapter says", max_tokens=n, temperature=0)


def test_an_adapter_added_at_run_time_serves_its_own_answers_and_is_metered_under_its_name(lmesh, adapters):
    m = lmesh
    tenant, key = new_tenant(m, prefix="lora")
    c = client(m, key)
    base = complete(c, MODEL)
    r = add(m, "support-bot", adapters["a"], "--owner", tenant)
    assert r.returncode == 0, r.stderr
    first = eventually(lambda: _served(c, "support-bot"), 15, every=0.25, what="the routers know the adapter")
    assert first.model == "support-bot", "the answer names the adapter, as vLLM's server does"
    assert first.choices[0].text != base.choices[0].text, "the adapter's weights change the greedy answer"
    again = complete(c, f"{MODEL}:support-bot")
    assert again.choices[0].text == first.choices[0].text, "base:adapter names the same adapter"
    assert complete(c, MODEL).choices[0].text == base.choices[0].text, "the base model's answers are unchanged"
    listed = {e.id: e for e in c.models.list().data}
    assert getattr(listed["support-bot"], "parent", None) == MODEL
    with BillingAdmin(instance(m, "billing-0"), m.run_dir) as b:
        rows = eventually(lambda: (u := b.usage(tenant, group_by="adapter"))["total"]["requests"] >= 4 and u["rows"],
                          15, every=0.25, what="the ledger has the requests")
    assert {g["group"]: g["requests"] for g in rows} == {MODEL: 2, f"{MODEL}:support-bot": 2}


def _served(c, model):
    try:
        return complete(c, model)
    except openai.NotFoundError:
        return None


def test_another_tenants_adapter_is_an_unknown_model_in_openais_shape(lmesh, adapters):
    m = lmesh
    owner, owner_key = new_tenant(m, prefix="owner")
    _, other_key = new_tenant(m, prefix="other")
    assert add(m, "private-bot", adapters["b"], "--owner", owner).returncode == 0
    eventually(lambda: _served(client(m, owner_key), "private-bot"), 15, every=0.25, what="the owner is served")
    for name in ("private-bot", f"{MODEL}:private-bot"):
        with pytest.raises(openai.NotFoundError) as info:
            complete(client(m, other_key), name)
        assert info.value.code == "model_not_found" and owner not in str(info.value)
    assert "private-bot" not in {e.id for e in client(m, other_key).models.list().data}


@pytest.mark.parametrize("adapter, says", [("r32", "over the pool's limit of 16"),
                                           ("wide", "made for another model")])
def test_an_adapter_that_does_not_fit_is_refused_before_anything_changes(lmesh, adapters, adapter, says):
    r = add(lmesh, f"bad-{adapter}", adapters[adapter], "--public")
    assert r.returncode != 0 and says in r.stderr, r.stderr
    listed = gaas(lmesh, "lora", "list", "--json")
    assert f"bad-{adapter}" not in {a["name"] for a in json.loads(listed.stdout)}


def test_a_deployment_that_would_strand_the_adapters_is_refused_before_anything_changes(lmesh, adapters, tmp_path):
    m = lmesh
    assert add(m, "kept-bot", adapters["a"], "--public").returncode == 0
    plain = tmp_path / "plain.yaml"
    plain.write_text(tiny_deployment("replicas: auto"))  # the same pool, without LoRA
    r = gaas(m, "apply", "-f", str(plain), "--run-dir", str(m.run_dir))
    assert r.returncode != 0 and "keep its engine's max_loras above 0" in r.stderr and "kept-bot" in r.stderr, \
        r.stdout + r.stderr
    _, key = new_tenant(m, prefix="kept")
    assert eventually(lambda: _served(client(m, key), "kept-bot"), 15, every=0.25, what="still served")
    gaas(m, "lora", "remove", "kept-bot")


def test_requests_stay_where_their_adapter_is_loaded_and_a_removed_one_is_unloaded(lmesh, adapters):
    m = lmesh
    tenant, key = new_tenant(m, prefix="affinity")
    c = client(m, key)
    assert add(m, "sticky", adapters["a"], "--public").returncode == 0
    eventually(lambda: _served(c, "sticky"), 15, every=0.25, what="served")
    held = eventually(lambda: holders(m, "sticky"), 15, every=0.25, what="a worker reports it loaded")
    assert len(held) == 1
    for _ in range(8):
        complete(c, "sticky", n=4)
    assert holders(m, "sticky") == held, "the affinity scorer kept its requests on the worker holding it"
    status = gaas(m, "status")
    assert any("adapters loaded" in line and "sticky" in line for line in status.stdout.splitlines()), status.stdout
    r = gaas(m, "lora", "remove", "sticky")
    assert r.returncode == 0, r.stderr
    eventually(lambda: _served(c, "sticky") is None, 15, every=0.25, what="its requests refused")
    eventually(lambda: not holders(m, "sticky"), 15, every=0.25, what="the worker unloaded it")


def test_more_adapters_than_an_engine_keeps_are_served_in_turn_evicting_the_least_recently_used(lmesh, adapters,
                                                                                                  tmp_path):
    """Engines here keep two adapters loaded (max_cpu_loras) and step with one (max_loras): five
    adapters taking turns are all served, their answers their own, no engine ever holding more
    than two."""
    m = lmesh
    _, key = new_tenant(m, prefix="turns")
    c = client(m, key)
    names = [f"turn-{i}" for i in range(5)]
    for i, name in enumerate(names):
        assert add(m, name, build(BASE, tmp_path / name, seed=50 + i), "--public").returncode == 0
    answers = {name: eventually(lambda n=name: _served(c, n), 15, every=0.25, what=f"{name} served").choices[0].text
               for name in names}
    assert len(set(answers.values())) > 1, "the adapters' answers are their own"
    for _ in range(2):
        for name in names:
            assert complete(c, name).choices[0].text == answers[name], f"{name} after evictions: the same answer"
    with pki.operator_channel(instance(m, "control-0"), m.run_dir) as ch:
        workers = control_pb2_grpc.ControlStub(ch).ListWorkers(control_pb2.ListWorkersRequest(), timeout=2).workers
    assert all(len(w.load.adapters) <= 2 for w in workers), [list(w.load.adapters) for w in workers]
    for name in names:
        gaas(m, "lora", "remove", name)


@on_direct_path("a worker primes its cache before it registers, whichever path serves")
def test_a_restarted_worker_primes_the_public_prefixes_before_it_takes_traffic(lmesh):
    """(A warm-up's part, tested on this module's mesh of two workers.) A worker that starts while
    a public prefix exists computes it before it registers: the first request of a new tenant that
    begins with it finds it cached."""
    m = lmesh
    system = " ".join(f"Rule {i}: answer in plain words and cite the source of each fact." for i in range(12))
    r = gaas(m, "kv", "public", "add", MODEL, "--text", system)
    assert r.returncode == 0, r.stderr
    r = gaas(m, "restart", "worker-1", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    def primed_blocks() -> int:
        stats = json.loads(gaas(m, "kv", "stats", "--json").stdout or "{}")
        return sum(int(w["blocks"]) for w in stats.get("per_worker", []) if w["worker_id"] == "worker-1")

    assert eventually(primed_blocks, 15, every=0.25,
                      what="the KV directory has worker-1's primed blocks (from its snapshot)") >= 8
    _, key = new_tenant(m, prefix="primed")
    first = client(m, key).chat.completions.create(
        model=MODEL, max_tokens=4, messages=[{"role": "system", "content": system},
                                             {"role": "user", "content": "What is a river?"}])
    assert first.usage.prompt_tokens_details.cached_tokens >= 64, first.usage

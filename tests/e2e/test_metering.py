"""Metering through the real mesh: the ledger's totals equal exactly the usage the clients
received (streamed and not, n > 1, prompt lists, gRPC), also with billing SIGKILLed and restarted
mid-load, with Redis restarted, and with Stripe failing for a while; budgets refuse a tenant past
them with HTTP 429 and serve it again when raised; a tenant reads its own usage and nobody else's."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import grpc
import openai
import pytest

from gaas.contracts import pricing
from gaas.sdk.admin import BillingAdmin
from gaas.sdk.client import GaasClient
from gaas.v1 import inference_pb2, inference_pb2_grpc
from tests.e2e.support import (GOLD, MODEL, Load, Received, children, client, instance, ledger_totals, needs_own_mesh,
                               new_tenant, stream_completion, wait_for_ledger, wait_restarted, wait_serving)
from tests.meshutil import gaas, http
from tests.waiting import eventually

pytestmark = pytest.mark.mesh



def test_the_ledger_equals_what_the_clients_received(mesh):
    tenant, key = new_tenant(mesh)
    c = client(mesh, key)
    received = Received()
    long_prompt = "The ledger counts every token a tenant is served, cached or not. " * 6
    # Streamed, with text in the chunk that carries the usage; twice, so the second hits the cache.
    stream_completion(c, received, long_prompt, 9, temperature=0)
    stream_completion(c, received, long_prompt, 9, temperature=0)
    # Not streamed, n > 1, a prompt list, chat both ways, a stop string.
    received.add(c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, n=3).usage)
    received.add(c.completions.create(model=MODEL, prompt=["one", "two words", "three more words"], max_tokens=4).usage)
    received.add(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6).usage)
    usage = None
    for chunk in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=7,
                                           stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
    received.add(usage)
    received.add(c.completions.create(model=MODEL, prompt="Once upon", max_tokens=30, stop=["e"], temperature=0).usage)
    # The native gRPC API: the last chunk carries the usage.
    with grpc.insecure_channel(mesh.ingress) as ch:
        chunks = list(inference_pb2_grpc.InferenceStub(ch).Generate(
            inference_pb2.GenerateRequest(prompt="gRPC too", max_tokens=6), timeout=60,
            metadata=(("authorization", f"Bearer {key}"),)))
    received.add(chunks[-1].usage)
    assert received.cached > 0, "the repeated long prompt was served from the prefix cache"
    wait_for_ledger(mesh, tenant, received.as_tuple())
    # What it cost: each request at the gold prices, summed, equals the ledger's cost.
    with BillingAdmin(instance(mesh, "billing-0")) as billing:
        report = billing.usage(tenant, group_by="model")
    assert [r["group"] for r in report["rows"]] == [MODEL]
    assert report["total"]["cost_usd"] > 0


def test_a_client_that_hangs_up_mid_stream_is_billed_for_what_it_was_sent(mesh):
    tenant, key = new_tenant(mesh)
    # Tokens counted by their logprobs entries, not chunks: a chunk is not always one token (CI saw
    # five chunks carry four tokens once, with random byte-level tokens).
    stream = client(mesh, key).completions.create(model=MODEL, prompt="Tell a long story", max_tokens=400,
                                                  stream=True, temperature=1.0, logprobs=1)
    got = received = 0
    for chunk in stream:
        got += 1
        received += len(chunk.choices[0].logprobs.tokens or []) if chunk.choices and chunk.choices[0].logprobs else 0
        if got == 5:
            break
    stream.close()
    requests, prompt, _, completion = eventually(lambda: (t := ledger_totals(mesh, tenant))[0] and t, 30, every=0.25,
                                                 what="the hung-up request in the ledger")
    assert requests == 1 and prompt > 0
    assert 1 <= received <= completion < 400, \
        "billed for the tokens produced before the client left, not the whole budget"


def test_no_prefill_without_a_bill(mesh):
    """Clients that hang up 5-200 ms after sending a long prompt, before their first token: every
    prompt an engine computed is in the ledger, and the ledger's prompt and cached tokens equal the
    engines' own counters (a request still in the router's queue is dropped unbilled, and untaken)."""
    from tests.conftest import MESH_WORKERS
    from tests.meshutil import cli_tenant, hang_ups_are_billed_for_what_engines_computed

    key = cli_tenant(mesh, "prefill-hangups")
    hang_ups_are_billed_for_what_engines_computed(mesh, MESH_WORKERS, "prefill-hangups", key)


def test_a_tenant_reads_its_own_usage_and_nobody_elses(mesh):
    a, key_a = new_tenant(mesh)
    b, key_b = new_tenant(mesh)
    ra, rb = Received(), Received()
    ra.add(client(mesh, key_a).completions.create(model=MODEL, prompt="tenant a", max_tokens=3).usage)
    rb.add(client(mesh, key_b).completions.create(model=MODEL, prompt="tenant b asks", max_tokens=5).usage)
    wait_for_ledger(mesh, a, ra.as_tuple())
    wait_for_ledger(mesh, b, rb.as_tuple())
    status, body = http(mesh, "/v1/gaas/usage?since=1h&by=model", method="GET", key=key_a)
    assert status == 200, body
    report = json.loads(body)
    assert report["tenant"] == a
    assert int(report["total"]["completion_tokens"]) == ra.completion
    assert [r["group"] for r in report["rows"]] == [MODEL]
    # The tenant is the key's: a tenant named in the query is not a parameter at all.
    status, body = http(mesh, f"/v1/gaas/usage?tenant={a}", method="GET", key=key_b)
    assert status == 200 and json.loads(body)["tenant"] == b
    with GaasClient(mesh.ingress, api_key=key_b) as g:
        assert g.usage(since="1d").total.completion_tokens == rb.completion
    assert http(mesh, "/v1/gaas/usage", method="GET", key="")[0] == 401
    status, body = http(mesh, "/v1/gaas/usage?by=tenant", method="GET", key=key_a)
    assert status == 400 and "by must be model, version, day, key" in body
    status, body = http(mesh, "/v1/gaas/usage?since=last+tuesday", method="GET", key=key_a)
    assert status == 400 and "ISO 8601" in body


def test_a_tenant_past_its_budget_gets_429_naming_it_until_the_budget_is_raised(mesh):
    tenant, key = new_tenant(mesh)
    c = client(mesh, key)
    c.completions.create(model=MODEL, prompt="spend a little", max_tokens=4)
    r = gaas(mesh, "budget", "set", tenant, "0.000001")
    assert r.returncode == 0, r.stderr
    with pytest.raises(openai.RateLimitError) as info:
        c.completions.create(model=MODEL, prompt="one more", max_tokens=4)
    err = info.value
    assert err.code == "insufficient_quota" and f"tenant {tenant} has used its monthly budget" in err.message
    assert int(err.response.headers["retry-after"]) >= 1
    # The native API says the same over gRPC.
    with grpc.insecure_channel(mesh.ingress) as ch:
        with pytest.raises(grpc.RpcError) as rpc:
            list(inference_pb2_grpc.InferenceStub(ch).Generate(
                inference_pb2.GenerateRequest(prompt="x", max_tokens=2), timeout=30,
                metadata=(("authorization", f"Bearer {key}"),)))
    assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "monthly budget" in rpc.value.details()
    assert gaas(mesh, "budget", "set", tenant, "25").returncode == 0
    assert c.completions.create(model=MODEL, prompt="served again", max_tokens=4).choices[0].text is not None
    shown = json.loads(gaas(mesh, "budget", "show", tenant, "--json").stdout)
    assert shown["amount_usd"] == 25 and shown["spent_usd"] > 0


def test_concurrent_requests_cannot_race_past_a_budget(mesh):
    tenant, key = new_tenant(mesh)
    prompt_ids, max_tokens = list(range(100, 140)), 24
    estimate = pricing.estimate_micros(GOLD, len(prompt_ids), max_tokens)
    budget = 3 * estimate + estimate // 2  # three requests' worst case fit at once, four do not
    with BillingAdmin(instance(mesh, "billing-0")) as billing:
        billing.set_budget(tenant, pricing.usd(budget))
    results: list[str] = []

    def one() -> None:
        with grpc.insecure_channel(mesh.ingress) as ch:
            try:
                list(inference_pb2_grpc.InferenceStub(ch).Generate(
                    inference_pb2.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=max_tokens), timeout=120,
                    metadata=(("authorization", f"Bearer {key}"),)))
                results.append("served")
            except grpc.RpcError as exc:
                results.append(exc.code().name)

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) <= {"served", "RESOURCE_EXHAUSTED"} and "RESOURCE_EXHAUSTED" in results
    served = results.count("served")
    eventually(lambda: ledger_totals(mesh, tenant)[0] >= served, 30, every=0.25,
               what=f"the {served} served requests in the ledger")
    with BillingAdmin(instance(mesh, "billing-0")) as billing:
        spent = billing.usage(tenant)["total"]["cost_usd"]
    assert pricing.micros(spent) <= budget, f"{served} requests spent {spent} past a budget of {pricing.usd(budget)}"


def test_operators_see_usage_invoices_and_the_stripe_sync(mesh):
    if mesh.stripe is None:
        pytest.skip("attached to a mesh without the test Stripe")
    tenant, key = new_tenant(mesh, tier="silver")
    client(mesh, key).completions.create(model=MODEL, prompt="an invoice", max_tokens=5)
    r = gaas(mesh, "tenant", "set", tenant, "--stripe-customer", "cus_invoice")
    assert r.returncode == 0 and "cus_invoice" in r.stdout, r.stderr
    bad = gaas(mesh, "tenant", "set", tenant, "--stripe-customer", "acme corp")
    assert bad.returncode == 1 and "cus_" in bad.stderr
    usage = eventually(lambda: (u := json.loads(gaas(mesh, "usage", tenant, "--by", "day", "--json").stdout))
                       ["total"]["requests"] == 1 and u, 30, every=0.25, what="the request in `gaas usage`")
    assert len(usage["rows"]) == 1
    table = gaas(mesh, "usage", tenant, "--by", "model")
    assert table.returncode == 0 and MODEL in table.stdout and "total" in table.stdout
    invoice = json.loads(gaas(mesh, "invoice", "preview", tenant, "--json").stdout)
    assert invoice["requests"] == 1 and {x["kind"] for x in invoice["lines"]} >= {"input", "output"}
    assert invoice["total_usd"] == pytest.approx(sum(x["amount_usd"] for x in invoice["lines"]))
    assert invoice["stripe_customer"] == "cus_invoice"
    status = json.loads(gaas(mesh, "status", "--json").stdout)
    assert status["billing"]["stripe_enabled"] is True
    assert gaas(mesh, "usage", tenant, "--since", "next week").returncode == 2


# ----------------------------------------------------------------- faults


def test_nothing_is_lost_when_billing_is_killed_mid_load(mesh):
    needs_own_mesh(mesh)
    tenant, key = new_tenant(mesh)
    with Load(mesh, key) as load:
        load.goes_on(3)
        pid = children(mesh)["billing-0"]
        os.kill(pid, signal.SIGKILL)
        load.goes_on(3)  # requests go on meanwhile; their events wait in the stream
        wait_restarted(mesh, "billing-0", pid)
        wait_serving(mesh, "billing-0")
        load.goes_on(2)
    assert load.errors == [] and load.received.requests > 5
    wait_for_ledger(mesh, tenant, load.received.as_tuple())
    assert "billing-0 restarted" in mesh.output.read_text()


def test_nothing_is_lost_when_redis_restarts(mesh):
    needs_own_mesh(mesh)
    tenant, key = new_tenant(mesh)
    with Load(mesh, key) as load:
        load.goes_on(3)
        pid = children(mesh)["redis"]
        os.kill(pid, signal.SIGTERM)  # a restart: Redis saves its append-only file and exits
        wait_restarted(mesh, "redis", pid)
        load.goes_on(3)  # served with the new Redis (the spools drain into it; the ledger is awaited below)
    assert load.errors == [] and load.received.requests > 5
    wait_for_ledger(mesh, tenant, load.received.as_tuple())
    # Whoever meters spools: the router on its own path, the workers on the direct path.
    logs = "".join(p.read_text() for p in (mesh.run_dir / "logs").glob("*-[0-9].log"))
    assert "spooled until it answers" in logs, "requests ended while Redis was away"


def test_stripe_failing_for_a_while_loses_nothing_and_catches_up(mesh):
    needs_own_mesh(mesh)
    stripe = mesh.stripe
    tenant, key = new_tenant(mesh, customer="cus_failing")
    with Load(mesh, key, clients=2) as load:
        load.goes_on(1)
        stripe.fail_for(8, status=503)
        time.sleep(10)  # the load runs on through the whole outage: its duration is what is tested
    wait_for_ledger(mesh, tenant, load.received.as_tuple())
    want = {"gaas_input_tokens": load.received.prompt - load.received.cached,
            "gaas_cached_input_tokens": load.received.cached, "gaas_output_tokens": load.received.completion}
    want = {k: v for k, v in want.items() if v}
    have: dict = {}

    def caught_up() -> bool:
        have.clear()
        have.update({name: v for (customer, name), v in stripe.totals().items() if customer == "cus_failing"})
        return have == want

    eventually(caught_up, 90, every=0.5, what=lambda: f"Stripe's meter events {have} to be the usage {want}")

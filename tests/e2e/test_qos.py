"""Admission and QoS through the real mesh: quotas set with `gaas tenant set` refuse a tenant past
them with HTTP 429 `rate_limit_exceeded` and Retry-After (RESOURCE_EXHAUSTED with a QuotaFailure
over gRPC), are lifted with `default`, and `gaas status` shows each router's queue, windows and
breakers. The machinery itself (bands, windows, breakers, the queue, the Redis scripts) is tested
without a mesh in tests/unit/router/test_flow.py and tests/unit/metering/test_quotas.py."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from gaas.contracts import errors
from gaas.runtime import status
from gaas.v1 import inference_pb2, inference_pb2_grpc
from tests.meshutil import gaas, served_again
from tests.e2e.support import MODEL, client, new_tenant

pytestmark = pytest.mark.mesh


def test_a_tenant_past_its_requests_per_minute_gets_429_with_retry_after_until_the_quota_is_lifted(mesh):
    tenant, key = new_tenant(mesh, tier="silver")
    r = gaas(mesh, "tenant", "set", tenant, "--rpm", "3")
    assert r.returncode == 0, r.stderr
    assert "3 requests/min" in r.stdout and "tokens/min (tier)" in r.stdout
    c = client(mesh, key)
    for _ in range(3):
        c.completions.create(model=MODEL, prompt="count me", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as info:
        c.completions.create(model=MODEL, prompt="one too many", max_tokens=2)
    err = info.value
    assert err.code == "rate_limit_exceeded"
    assert f"tenant {tenant} has made 3 requests in the last minute, its quota is 3 requests per minute" in err.message
    assert 1 <= int(err.response.headers["retry-after"]) <= 60
    # The native API refuses alike, naming the quota in a QuotaFailure detail.
    with grpc.insecure_channel(mesh.ingress) as ch:
        with pytest.raises(grpc.RpcError) as rpc:
            list(inference_pb2_grpc.InferenceStub(ch).Generate(
                inference_pb2.GenerateRequest(prompt="x", max_tokens=2), timeout=30,
                metadata=(("authorization", f"Bearer {key}"),)))
    assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    back = status.from_rpc(rpc.value)
    assert back.quota == errors.QuotaViolation(f"tenant:{tenant}", "requests per minute: 3")
    assert back.reason == "rate_limit_exceeded" and back.retry_after >= 1
    # Back to the tier's quota (silver: thousands a minute).
    r = gaas(mesh, "tenant", "set", tenant, "--rpm", "default")
    assert r.returncode == 0 and "requests/min (tier)" in r.stdout, r.stdout + r.stderr
    served_again(c)


def test_a_tenant_at_its_concurrency_limit_is_refused_until_a_stream_finishes(mesh):
    tenant, key = new_tenant(mesh, tier="bronze")
    assert gaas(mesh, "tenant", "set", tenant, "--concurrency", "1").returncode == 0
    c = client(mesh, key)
    stream = c.completions.create(model=MODEL, prompt="a long one", max_tokens=400, stream=True,
                                  extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices
    with pytest.raises(openai.RateLimitError) as info:
        c.completions.create(model=MODEL, prompt="a second at once", max_tokens=2)
    assert info.value.code == "rate_limit_exceeded"
    assert f"tenant {tenant} has 1 sequences in flight (each choice of each prompt counts), its limit is 1 at once" \
        in info.value.message
    stream.close()
    served_again(c)


def test_a_request_larger_than_the_tokens_per_minute_quota_says_to_ask_for_fewer(mesh):
    tenant, key = new_tenant(mesh, tier="gold")
    assert gaas(mesh, "tenant", "set", tenant, "--tpm", "64").returncode == 0
    c = client(mesh, key)
    with pytest.raises(openai.RateLimitError) as info:
        c.completions.create(model=MODEL, prompt="hello there", max_tokens=100)
    assert info.value.code == "rate_limit_exceeded" and info.value.param == "max_tokens"
    assert "quota of 64 tokens per minute: ask for fewer max_tokens" in info.value.message
    # A request that fits is served.
    assert c.completions.create(model=MODEL, prompt="hi", max_tokens=8).usage.completion_tokens == 8


def test_tenant_list_shows_quotas_and_which_come_from_the_tier(mesh):
    tenant, _ = new_tenant(mesh, tier="bronze")
    assert gaas(mesh, "tenant", "set", tenant, "--rpm", "0").returncode == 0
    listed = json.loads(gaas(mesh, "tenant", "list", "--json").stdout)
    mine = next(t for t in listed if t["name"] == tenant)
    assert mine["limits"]["rpm"] == 0 and mine["own_limits"] == ["rpm"]
    assert mine["limits"]["concurrency"] > 0  # bronze's default (deploy/gaas.yaml)
    text = gaas(mesh, "tenant", "list").stdout
    assert any(tenant in line and "unlimited requests/min," in line and "at once (tier)" in line
               for line in text.splitlines())
    bad = gaas(mesh, "tenant", "set", tenant, "--rpm", "-5")
    assert bad.returncode == 2 and "must be 0 (unlimited) or more" in bad.stderr


def test_gaas_status_shows_each_routers_queue_windows_and_breakers(mesh):
    client(mesh, mesh.api_key).completions.create(model=MODEL, prompt="warm", max_tokens=2)
    shown = json.loads(gaas(mesh, "status", "--json").stdout)
    flow = shown["flow"][0]
    assert flow["qos_enabled"] is True
    assert [b["band"] for b in flow["bands"]] == ["gold", "silver", "bronze", "batch"]
    assert {w["worker_id"] for w in flow["workers"]} == {w["worker_id"] for w in mesh.ready["workers"]}
    assert all(w["breaker"] == "closed" and w["window"] >= 1 for w in flow["workers"])
    text = gaas(mesh, "status").stdout
    assert "router-0: flow control on" in text and "breaker closed" in text and "gold 0 waiting" in text

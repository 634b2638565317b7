"""Who may register a worker (gaas.contracts.identity.Caller.may_register): a worker's own
certificate (gaas up) names its id and sidecar address; a pool's (Kubernetes: one per worker
Deployment) lets its pods register their own names at the address their connection comes from."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gaas.contracts.identity import Caller, spiffe_id

POOL = Caller(spiffe_id("worker", "gaas-worker-tiny-1-0-0"), peer="10.0.0.7")
OWN = Caller(spiffe_id("worker", "worker-0"), sidecar="127.0.0.1:20061")


def test_a_pod_of_the_pool_registers_at_its_own_address():
    assert POOL.may_register("gaas-worker-tiny-1-0-0-5d8c7-x2x9z", "10.0.0.7:9001")


def test_a_pod_of_the_pool_may_not_register_another_address_or_another_pools_worker():
    assert not POOL.may_register("gaas-worker-tiny-1-0-0-5d8c7-x2x9z", "10.0.0.8:9001")
    assert not POOL.may_register("gaas-worker-small-1-0-0-abc", "10.0.0.7:9001")
    assert not POOL.may_register("gaas-worker-tiny-1-0-0", "10.0.0.7:9001")  # (the pool itself is no worker)
    assert not Caller(POOL.identity).may_register("gaas-worker-tiny-1-0-0-a", "10.0.0.7:9001")  # no peer known


def test_a_workers_own_certificate_names_its_id_and_sidecar():
    assert OWN.may_register("worker-0", "127.0.0.1:20061")
    assert not OWN.may_register("worker-0", "127.0.0.1:20071")
    assert not OWN.may_register("worker-0-x")


@given(st.sampled_from(["router", "control", "ingress", "operator"]), st.text(min_size=1, max_size=20))
def test_no_other_kind_registers_a_worker(kind, suffix):
    caller = Caller(spiffe_id(kind, "gaas-worker-tiny"), peer="10.0.0.7")
    assert not caller.may_register(f"gaas-worker-tiny-{suffix}", "10.0.0.7:9001")

"""Autoscaling on a live mesh of its own (gaas-tiny autoscaled between 0 and 2 workers, one to start
with), as `gaas up` runs it: under a step load the autoscaler adds a worker, which warms up and
serves, and removes it once the load has ended, no request failing either way; left idle, the pool
goes to zero workers, and the next request waits at the router while a worker starts, then is
served. `gaas status` says what was decided and why."""

from __future__ import annotations

import json
import time

import pytest

from bench.autoscale import deployment
from gaas.sdk.admin import Admin
from tests.conftest import on_direct_path
from tests.e2e.support import Load, client, instance, new_tenant
from tests.meshutil import gaas, generate, own_mesh
from tests.waiting import eventually

pytestmark = [pytest.mark.mesh]
MODEL = "gaas-tiny"
# A worker loads its engine in ~10-20 s on a CPU; more while others are busy.
START_SECONDS = 240


@pytest.fixture(scope="module")
def amesh(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("autoscale-mesh")
    deploy = run_dir / "deploy.yaml"
    deploy.write_text(deployment(queue_timeout_s=START_SECONDS))
    with own_mesh(run_dir, port_start=25000, workers=1, ingress_path="direct", args=("--deploy", str(deploy))) as m:
        yield m


def pool(m) -> dict:
    with Admin(instance(m, "control-0"), m.run_dir) as a:
        return next(p for p in a.pools() if p["model"] == MODEL)


def serving(m) -> list[str]:
    from gaas.v1 import control_pb2, control_pb2_grpc
    from gaas.ops import pki

    with pki.operator_channel(instance(m, "control-0"), m.run_dir) as ch:
        workers = control_pb2_grpc.ControlStub(ch).ListWorkers(control_pb2.ListWorkersRequest(), timeout=2).workers
    return sorted(w.worker_id for w in workers if w.state == control_pb2.WORKER_STATE_SERVING)


def wait_for(what: str, check, timeout: float) -> float:
    """Seconds until check() holds."""
    start = time.monotonic()
    eventually(check, timeout, every=0.5, what=lambda: f"{what} (pool: {pool_said()})")
    return time.monotonic() - start


_last_pool: dict = {}


def pool_said() -> dict:
    return _last_pool


def replicas(m) -> int:
    p = pool(m)
    _last_pool.clear()
    _last_pool.update(p)
    return int(p["replicas"])


@on_direct_path("the autoscaler and gaas up act alike whichever path serves; the wait for a worker is the pipeline's")
def test_a_step_load_adds_a_worker_that_serves_and_its_end_removes_it_failing_no_request(amesh):
    m = amesh
    assert serving(m) == ["worker-0"] and replicas(m) == 1, "an autoscaled pool starts with one worker"
    _, key = new_tenant(m, prefix="scale")
    with Load(m, key, clients=6, pause=0) as load:  # a step of demand, unpaced: what scales the pool
        wait_for("a worker more asked for", lambda: replicas(m) == 2, 60)
        took = wait_for("the new worker serving", lambda: "worker-1" in serving(m), START_SECONDS)
        md = (("authorization", f"Bearer {key}"),)
        wait_for("a request served by the new worker",
                 lambda: generate(m, md, prompt=f"on the new worker {time.monotonic_ns()}",
                                  max_tokens=1)[-1].worker_id == "worker-1", 60)
    assert "requests per serving worker" in pool(m)["autoscale"]["reason"]
    print(f"\nthe second worker served {took:.0f} s after it was asked for (its start and warm-up)")
    assert load.errors == [], load.errors[:3]
    assert load.received.requests > 0
    wait_for("back to one worker", lambda: replicas(m) == 1, 60)
    wait_for("the removed worker gone", lambda: serving(m) == ["worker-0"], 120)
    assert "fit in 1 worker" in pool(m)["autoscale"]["reason"]


@on_direct_path("the autoscaler and gaas up act alike whichever path serves; the wait for a worker is the pipeline's")
def test_an_idle_pool_goes_to_zero_and_its_next_request_waits_for_a_worker_and_is_served(amesh):
    m = amesh
    wait_for("the idle pool at zero", lambda: replicas(m) == 0, 120)
    wait_for("its last worker gone", lambda: serving(m) == [], 120)
    assert "idle for" in pool(m)["autoscale"]["reason"]
    _, key = new_tenant(m, prefix="zero")
    # No retry by the client: the router holds the request until a worker serves and its own sidecar
    # knows that worker (services/router/relay.py, SIDECAR_UNKNOWN), never a 503 no_healthy_upstream.
    c = client(m, key).with_options(timeout=START_SECONDS + 60, max_retries=0)
    start = time.monotonic()
    r = c.completions.create(model=MODEL, prompt="the first request after zero", max_tokens=4)
    took = time.monotonic() - start
    assert r.choices[0].text and r.usage.completion_tokens == 4
    print(f"\nscale from zero: the first request served in {took:.0f} s")
    assert "a request waits" in pool(m)["autoscale"]["reason"]
    out = gaas(m, "status", "--json", "--run-dir", str(m.run_dir))
    said = json.loads(out.stdout)["autoscaled"]
    assert said and said[0]["model"] == MODEL and said[0]["autoscale"]["max"] == 2

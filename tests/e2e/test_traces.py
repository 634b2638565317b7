"""Traces on the running mesh (started with --trace): one request is one trace with a span from every
Envoy and service it crossed, the routing decision on the router's; the mesh's own background calls
make none; `gaas top` shows the workers, queues and the tenant that just sent."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from gaas.ops import traces
from gaas.ops.traces import TraceError
from tests.conftest import INGRESS_PATH
from tests.meshutil import gaas, generate
from tests.waiting import eventually

# ------------------------------------------------------------------ where spans go


def _wait_for_trace(path: Path, request_id: str, want_services: set[str], timeout: float = 20.0) -> traces.Trace:
    """The request's trace once every service in want_services has exported its spans and every
    span's parent is in (Envoys flush every 5 s, the SDK's batch processor as often: a child's span,
    ended first, can arrive a flush before its parent's, at any depth; CI read traces with two roots
    while the root's or an intermediate span's parent was still to come). A trace still split when
    timeout passes is returned as it is, for the caller's assertions to name."""
    seen: list = []

    def whole():
        t = traces.find(traces.load(path), request_id)
        seen[:] = [t] if want_services <= set(t.services()) else []
        return t if seen and len(t.roots()) == 1 else None

    try:
        return eventually(whole, timeout, every=0.5, ignoring=(TraceError,),
                          what=f"a complete trace of {request_id} through {sorted(want_services)}")
    except pytest.fail.Exception:
        if seen:
            return seen[0]  # every service's spans, still split: the caller's assertions name it
        raise


@pytest.mark.mesh
def test_one_request_is_one_trace_across_every_envoy_and_service_it_crossed(mesh):
    request_id = f"trace-{uuid.uuid4().hex[:12]}"
    chunks = generate(mesh, metadata=mesh.auth + (("x-request-id", request_id),), prompt="trace me", max_tokens=4)
    final = chunks[-1]
    assert final.timings.trace_id, "the final chunk names the request's trace"
    worker = final.worker_id
    if INGRESS_PATH == "direct":
        # The ingress asks the router (ext_proc, through its sidecar) and sends the request to the
        # worker's sidecar itself: one trace, the worker's final chunk naming it.
        want = {"envoy-ingress", "envoy-sidecar-router-0", f"envoy-sidecar-{worker}"}
        t = _wait_for_trace(mesh.run_dir / traces.TRACES_FILE, request_id, want)
        assert t.trace_id == final.timings.trace_id
        (root,) = t.roots()
        assert (root.service, root.name) == ("envoy-ingress", "ingress to a worker")
        assert any(s.service == "envoy-ingress" and "ExternalProcessor.Process" in s.name for s in t.spans)
        return
    # (control's Authenticate is in it too unless the router had the key cached)
    want = {"envoy-ingress", "envoy-sidecar-router-0", "gaas-router", f"envoy-sidecar-{worker}", "gaas-worker"}
    t = _wait_for_trace(mesh.run_dir / traces.TRACES_FILE, request_id, want)
    assert t.trace_id == final.timings.trace_id
    (root,) = t.roots()
    assert (root.service, root.name) == ("envoy-ingress", "ingress")

    def chain(span, path=()):
        path = (*path, (span.service, span.name))
        yield path
        for c in span.children:
            yield from chain(c, path)

    # The generation's path, each hop the parent of the next.
    paths = list(chain(root))
    assert any([s for s, _ in p] == ["envoy-ingress", "envoy-sidecar-router-0", "gaas-router", "gaas-router",
                                     "envoy-sidecar-router-0", f"envoy-sidecar-{worker}", "gaas-worker"]
               and p[-1][1] == "/gaas.v1.Worker/Generate" for p in paths), paths
    routed = next(s for s in t.spans if s.service == "gaas-router" and s.name == "/gaas.v1.Inference/Generate")
    assert routed.attributes["gaas.worker"] == worker
    assert routed.attributes["gaas.request_id"] == final.request_id
    assert routed.attributes["gaas.policy"] and "gaas.queue_ms" in routed.attributes
    # Children start within their parents.
    by_id = {s.span_id: s for s in t.spans}
    for s in t.spans:
        if s.parent_id in by_id:
            assert s.start_ns >= by_id[s.parent_id].start_ns - 1_000_000  # clocks of one host, 1 ms slack

    shown = gaas(mesh, "trace", request_id)
    assert shown.returncode == 0, shown.stderr
    assert f"worker={worker}" in shown.stdout and "envoy-ingress: ingress" in shown.stdout
    listed = gaas(mesh, "trace", "--list", "--json")
    assert any(final.request_id in x["request_ids"] for x in json.loads(listed.stdout))


@pytest.mark.mesh
def test_the_mesh_own_background_calls_make_no_traces(mesh):
    generate(mesh, prompt="only this", max_tokens=2)
    time.sleep(6)  # leases renew and registries refresh meanwhile
    collected = traces.load(mesh.run_dir / traces.TRACES_FILE)
    # A client's request leaves a span in the router's public methods, its key check or its decision
    # call, even where Envoy's exporter dropped the ingress's own (it drops spans when the collector
    # falls behind: a few did under the fuzzing before this, every request traced on two cores).
    client_methods = ("/gaas.v1.OpenAI/", "/gaas.v1.Inference/", "/envoy.service.auth.v3.Authorization/",
                      "/envoy.service.ext_proc.v3.ExternalProcessor/")
    background = [t for t in collected.values() if not any(s.service == "envoy-ingress" for s in t.spans)
                  and not any(s.name.startswith(client_methods) for s in t.spans)]
    assert not background, [(t.trace_id, [(s.service, s.name) for s in t.spans]) for t in background[:3]]


@pytest.mark.mesh
def test_gaas_top_shows_the_workers_queues_and_the_tenant_that_just_sent(mesh):
    generate(mesh, prompt="top", max_tokens=3)
    out = gaas(mesh, "top", "--once")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for w in mesh.ready["workers"]:
        assert any(line.startswith(w["worker_id"]) for line in lines), out.stdout
    assert any(line.startswith("gold") for line in lines)
    assert any(line.startswith("demo ") for line in lines), out.stdout

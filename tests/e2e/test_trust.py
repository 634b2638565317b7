"""Trust inside the running mesh: every internal method called without a certificate, with one from
another CA, or with a mesh identity that does not need it is refused, and stays refused; a worker
cannot register, renew or remove another; services are reachable only through their sidecars."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import grpc
import pytest

from gaas.ops import pki
from gaas.ops.topology import LocalSockets, load, sockets_root
from gaas.v1 import (billing_pb2, billing_pb2_grpc, control_pb2, control_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc,
                     router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc)
from tests.conftest import INGRESS_PATH, MESH_WORKERS, ROOT, process_alive
from tests.meshutil import generate

pytestmark = pytest.mark.mesh


def topo(mesh):
    return load(ROOT / "deploy" / "topology.yaml", env={}, port_base=mesh.port_base,
                ingress_port=int(mesh.ingress.rsplit(":", 1)[1]), workers=MESH_WORKERS)


def call(kind: str, method: str, ch):
    """One call of an internal method with an empty request (a refusal comes before the request is read)."""
    stubs = {
        "control": control_pb2_grpc.ControlStub, "worker": worker_pb2_grpc.WorkerStub,
        "kvcache": kvcache_pb2_grpc.KVCacheStub, "billing": billing_pb2_grpc.BillingStub,
        "router": router_pb2_grpc.RouterStub,
    }
    fn = getattr(stubs[kind](ch), method)
    req = {
        "CreateApiKey": control_pb2.CreateApiKeyRequest(tenant="demo"),
        "CreateTenant": control_pb2.CreateTenantRequest(name="intruder"),
        "RegisterWorker": control_pb2.RegisterWorkerRequest(),
        "Authenticate": control_pb2.AuthenticateRequest(),
        "Generate": worker_pb2.WorkerGenerateRequest(),
        "WatchKVEvents": worker_pb2.WatchKVEventsRequest(),
        "Lookup": kvcache_pb2.LookupRequest(),
        "SetBudget": billing_pb2.SetBudgetRequest(),
        "GetFlowStatus": router_pb2.GetFlowStatusRequest(),
        "ListTenantSessions": router_pb2.TenantSessionsRequest(tenant="demo"),
    }[method]
    result = fn(req, timeout=5)
    return list(result) if method in ("Generate", "WatchKVEvents") else result


# (service kind, method, identities of the mesh that must not call it)
REFUSED = [
    ("control", "CreateApiKey", [("worker", "worker-0"), ("router", "router-0"), ("billing", "billing-0"), pki.INGRESS]),
    ("control", "CreateTenant", [("kvcache", "kvcache-0"), ("router", "router-0")]),
    ("control", "RegisterWorker", [pki.OPERATOR, ("router", "router-0"), ("kvcache", "kvcache-0")]),
    # (the operator may: `gaas up` checks the demo key it saved at an earlier start)
    ("control", "Authenticate", [("worker", "worker-1"), ("billing", "billing-0"), pki.INGRESS]),
    # (on the direct path a worker may: it carries on there a stream its engine could not finish)
    ("worker", "Generate", [pki.OPERATOR, ("kvcache", "kvcache-0"), pki.INGRESS,
                            *([("worker", "worker-1")] if INGRESS_PATH == "router" else [])]),
    ("worker", "WatchKVEvents", [("router", "router-0"), pki.OPERATOR]),
    ("kvcache", "Lookup", [("worker", "worker-0"), pki.OPERATOR]),
    ("billing", "SetBudget", [("router", "router-0"), ("worker", "worker-0")]),
    ("router", "GetFlowStatus", [pki.INGRESS, ("worker", "worker-0")]),
    # (a tenant reads its own sessions with its API key; any tenant's are the operator's)
    ("router", "ListTenantSessions", [pki.INGRESS, ("worker", "worker-0"), ("kvcache", "kvcache-0")]),
]


def _target(mesh, kind: str) -> str:
    return topo(mesh).of(kind)[0].inbound


def _authority(mesh) -> pki.Authority:
    return pki.Authority(mesh.run_dir.resolve())


@pytest.mark.parametrize("kind", ["control", "worker", "kvcache", "billing", "router"])
def test_without_a_certificate_nothing_internal_answers(mesh, kind):
    method = next(m for k, m, _ in REFUSED if k == kind)
    with grpc.insecure_channel(_target(mesh, kind)) as ch:
        with pytest.raises(grpc.RpcError) as err:
            call(kind, method, ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_of_another_ca_is_refused(mesh, tmp_path):
    other = pki.Authority(tmp_path)
    other.ensure()
    forged = other.issue(*pki.OPERATOR)  # the operator's name, signed by someone else
    with pki.channel(_target(mesh, "control"), forged) as ch:
        with pytest.raises(grpc.RpcError) as err:
            call("control", "CreateTenant", ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("kind, method, identities", REFUSED, ids=[f"{k}.{m}" for k, m, _ in REFUSED])
def test_each_identity_calls_only_what_it_needs(mesh, kind, method, identities):
    for identity in identities:
        with pki.channel(_target(mesh, kind), _authority(mesh).credentials(*identity)) as ch:
            with pytest.raises(grpc.RpcError) as err:
                call(kind, method, ch)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (identity, err.value)


def _registered(mesh) -> dict[str, str]:
    with pki.operator_channel(_target(mesh, "control")) as ch:
        workers = control_pb2_grpc.ControlStub(ch).ListWorkers(control_pb2.ListWorkersRequest(), timeout=5).workers
    return {w.worker_id: w.address for w in workers}


def test_a_worker_cannot_take_over_or_remove_another_and_stays_refused(mesh):
    t = topo(mesh)
    before = _registered(mesh)
    assert before == {w.name: w.inbound for w in t.of("worker")}
    creds = _authority(mesh).credentials("worker", "worker-0")
    with pki.channel(_target(mesh, "control"), creds) as ch:
        stub = control_pb2_grpc.ControlStub(ch)
        attempts = [
            # worker-0's certificate, registering as worker-1 (at worker-0's own sidecar, or anywhere).
            lambda: stub.RegisterWorker(control_pb2.RegisterWorkerRequest(worker=control_pb2.WorkerInfo(
                worker_id="worker-1", address=t.instance("worker-0").inbound, model="gaas-tiny")), timeout=5),
            # worker-0 at an address that is not its sidecar.
            lambda: stub.RegisterWorker(control_pb2.RegisterWorkerRequest(worker=control_pb2.WorkerInfo(
                worker_id="worker-0", address="127.0.0.1:1", model="gaas-tiny")), timeout=5),
            lambda: stub.DeregisterWorker(control_pb2.DeregisterWorkerRequest(worker_id="worker-1"), timeout=5),
            lambda: stub.RenewLease(control_pb2.RenewLeaseRequest(worker_id="worker-1",
                                                                  state=control_pb2.WORKER_STATE_DRAINING), timeout=5),
        ]
        for _ in range(2):  # and again: a refusal changes nothing that would let the next try in
            for attempt in attempts:
                with pytest.raises(grpc.RpcError) as err:
                    attempt()
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert _registered(mesh) == before
    assert generate(mesh, prompt="still mine", max_tokens=2)[-1].worker_id in before


def test_services_and_envoy_admin_listen_only_where_their_owner_can_reach(mesh):
    t = topo(mesh)
    root = sockets_root(mesh.run_dir.resolve())
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    for inst in t.instances:
        local = LocalSockets.of(root, inst.name)
        assert stat.S_IMODE(os.stat(local.dir).st_mode) == 0o700, inst.name
        assert local.service.is_socket() and local.admin.is_socket(), inst.name
        # Neither the service's nor the Envoy admin's TCP port of the topology is open.
        for port in (inst.port, inst.admin_port, *([inst.outbound_port] if inst.service != "control" else [])):
            with socket.socket() as s:
                assert s.connect_ex((inst.host, port)) != 0, f"{inst.name} listens on TCP {port}"
    with socket.socket() as s:
        assert s.connect_ex((t.host, t.ingress_admin_port)) != 0
    pki_dir = _authority(mesh).dir
    assert stat.S_IMODE(os.stat(pki_dir).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(k).st_mode) == 0o600 for k in Path(pki_dir).glob("*.key"))


def test_each_process_of_the_mesh_holds_only_the_secrets_its_job_needs(mesh):
    """Read from the running processes themselves: the Stripe key is billing's alone, the
    operator's Redis password nobody's (each service is a Redis user of its own), and an Envoy or
    the Redis holds no GAAS_ secret at all."""
    def environ(pid: int) -> dict[str, str]:
        raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)

    operator_password = (mesh.run_dir / "redis-password").read_text().strip()
    children = json.loads((mesh.run_dir / "mesh.json").read_text())["children"]  # (restarted ones too)
    envs = {name: environ(pid) for name, pid in children.items() if process_alive(pid)}
    assert sorted(n for n, e in envs.items() if "GAAS_STRIPE_API_KEY" in e) == ["billing-0"]
    assert [n for n, e in envs.items() if operator_password in "".join(e.values())] == []
    for name, env in envs.items():
        if name.startswith(("sidecar-", "ingress-", "redis")):
            assert [k for k in env if k.startswith("GAAS_") and k != "GAAS_ENVOY_NAME"] == [], name
        elif name.startswith(("router-", "control-", "billing-", "worker-")):
            assert env["GAAS_REDIS_URL"].startswith(f"redis://gaas-{name.split('-')[0]}:"), name

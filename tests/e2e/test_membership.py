"""Live membership: every Envoy that reaches workers takes their endpoints from control (xDS), so a
worker that registers is reachable and one that leaves is not, with no Envoy restarted."""

import asyncio
import json

import redis.asyncio as aioredis

from gaas.contracts.ids import WorkerId
from gaas.ops import probe
from gaas.ops.topology import LocalSockets, sockets_root
from services.control.registry import WorkerRecord, WorkerRegistry
from tests.conftest import INGRESS_PATH
from tests.meshutil import worker_addresses
from tests.waiting import eventually

# The Envoys that reach workers: the router's and the KV directory's sidecars, and on the direct
# path the ingress and the workers' own (they carry streams on at each other).
REACHING = ("router-0", "kvcache-0", *(("ingress-0", "ingress-1", "worker-0") if INGRESS_PATH == "direct" else ()))


def endpoints(mesh, envoy: str) -> set[str]:
    """host:port of each endpoint in that Envoy's workers cluster (its admin's /clusters)."""
    admin = LocalSockets.of(sockets_root(mesh.run_dir.resolve()), envoy).admin
    status, body = probe.envoy_admin(admin, "/clusters?format=json")
    assert status == 200, body[:200]
    out = set()
    for cluster in json.loads(body)["cluster_statuses"]:
        if cluster["name"] == "workers":
            for host in cluster.get("host_statuses", []):
                addr = host["address"]["socket_address"]
                out.add(f"{addr['address']}:{addr['port_value']}")
    return out


def wait_endpoints(mesh, envoys, want, timeout: float = 5.0) -> None:
    seen: dict = {}

    def agreed() -> bool:
        seen.update({e: endpoints(mesh, e) for e in envoys})
        return all(v == want for v in seen.values())

    eventually(agreed, timeout, what=lambda: f"the Envoys' endpoints {sorted(want)} (they have {seen})")


def test_every_envoy_that_reaches_workers_has_exactly_the_registered_ones(mesh):
    wait_endpoints(mesh, REACHING, set(worker_addresses(mesh).values()))


def test_a_worker_that_registers_is_an_endpoint_at_once_and_one_that_leaves_is_not(mesh):
    redis_url = json.loads((mesh.run_dir / "mesh.json").read_text())["redis_url"]
    pids = dict(mesh.children)
    known = set(worker_addresses(mesh).values())
    # A worker of a model no router serves here (so no request is sent to it), registered as a
    # worker registers: the registry in Redis, which every control replica reads.
    newcomer = WorkerRecord(WorkerId("worker-97"), "127.0.0.1:1997", "gaas-elsewhere", "9.9.9", "vllm-cpu", "cpu",
                            32, 2048)

    async def register(leave: bool) -> None:
        r = aioredis.from_url(redis_url, decode_responses=True)
        reg = WorkerRegistry(r, ttl_seconds=30)
        await (reg.deregister(newcomer.worker_id) if leave else reg.register(newcomer))
        await r.aclose()

    asyncio.run(register(leave=False))
    try:
        wait_endpoints(mesh, REACHING, known | {newcomer.address})
    finally:
        asyncio.run(register(leave=True))
    wait_endpoints(mesh, REACHING, known)
    # No Envoy was restarted for it.
    now = json.loads((mesh.run_dir / "mesh.json").read_text())["children"]
    assert {k: v for k, v in now.items() if k in pids} == pids

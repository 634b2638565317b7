"""What end-to-end test modules share beyond starting a mesh (tests/meshutil.py): tenants and their
clients, the ledger's totals against what clients received, background load, the mesh's processes
(killed, restarted, serving again), and plain HTTP at the ingress (on conftest.py's conn). Test modules
import from here, never from one another."""

from __future__ import annotations

import http.client as httpclient
import itertools
import json
import os
import threading
import time
from dataclasses import dataclass
from functools import partial

import openai
import pytest

from gaas.contracts import pricing
from gaas.sdk.admin import Admin, BillingAdmin
from tests.conftest import process_alive
from tests.meshutil import openai_client
from tests.waiting import eventually

MODEL = "gaas-tiny"
GOLD = pricing.Price(input=0.60, cached_input=0.06, output=2.40)  # deploy/gaas.yaml's gold prices
_names = itertools.count()

# The openai client as the metering tests use it (a generous timeout: the host is shared).
client = partial(openai_client, timeout=120)


def instance(mesh, name: str) -> str:
    """The address of the mesh's instance `name` (control-0, billing-0...)."""
    return next(i["address"] for i in mesh.ready["instances"] if i["name"] == name)


def new_tenant(mesh, tier: str = "gold", customer: str = "", prefix: str = "meter") -> tuple[str, str]:
    """A tenant of its own (a unique name from prefix) and its API key."""
    name = f"{prefix}-{next(_names)}-{os.getpid() % 1000}-{int(time.time() * 1000) % 1_000_000}"
    with Admin(instance(mesh, "control-0"), mesh.run_dir) as admin:
        admin.create_tenant(name, tier)
        if customer:
            admin.update_tenant(name, stripe_customer=customer)
        _, key = admin.create_key(name)
    return name, key


@dataclass
class Received:
    """What the clients were told they used."""

    requests: int = 0
    prompt: int = 0
    cached: int = 0
    completion: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, usage, requests: int = 1) -> None:
        details = getattr(usage, "prompt_tokens_details", None)
        with self._lock:
            self.requests += requests
            self.prompt += usage.prompt_tokens
            self.cached += (details.cached_tokens or 0) if details else 0
            self.completion += usage.completion_tokens

    def as_tuple(self) -> tuple[int, int, int, int]:
        return self.requests, self.prompt, self.cached, self.completion


def ledger_totals(mesh, tenant) -> tuple[int, int, int, int]:
    """The tenant's (requests, prompt, cached, completion tokens) in the ledger."""
    with BillingAdmin(instance(mesh, "billing-0")) as billing:
        t = billing.usage(tenant)["total"]
    return t["requests"], t["prompt_tokens"], t["cached_tokens"], t["completion_tokens"]


def wait_for_ledger(mesh, tenant, want: tuple, timeout=60.0) -> None:
    """Until the tenant's ledger totals are want (billing may be restarting meanwhile)."""
    seen = []

    def matches() -> bool:
        seen[:] = [ledger_totals(mesh, tenant)]
        return seen[0] == want

    eventually(matches, timeout, every=0.25, ignoring=(Exception,),
               what=lambda: f"ledger of {tenant}: {seen[0] if seen else None}, clients received {want} "
                            "(requests, prompt, cached, completion)")


def stream_completion(c: openai.OpenAI, received: Received, prompt: str, max_tokens: int, **kw) -> None:
    """One streamed completion, its usage added to received."""
    usage = None
    for chunk in c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                      stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None, "a stream with include_usage ends with the usage"
    received.add(usage)


class Load:
    """Clients streaming completions in the background, counting the usage they receive. Each
    pauses `pause` seconds between its requests: the requests keep coming, and the host keeps
    the CPU a worker needs to start meanwhile (three clients without pauses held both cores, and a
    restarting worker took 45 s to import vLLM, not 14)."""

    def __init__(self, mesh, key: str, clients: int = 3, pause: float = 0.1) -> None:
        self.pause = pause
        self.received = Received()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._client = client(mesh, key)
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                stream_completion(self._client, self.received, f"load {i} request {n}", 6 + n % 5)
            except Exception as exc:  # noqa: BLE001 - collected and asserted on
                self.errors.append(repr(exc))
            self._stop.wait(self.pause)

    def goes_on(self, more: int, timeout: float = 30.0) -> None:
        """Until `more` requests beyond those finished now have finished: the load went on (a fault
        meanwhile, or a process back since)."""
        start = self.received.requests
        eventually(lambda: self.received.requests >= start + more, timeout, every=0.1,
                   what=lambda: f"{more} more requests of the load to finish (from {start}: "
                                f"{self.received.requests}; last errors {self.errors[-3:]})")

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)


def children(mesh) -> dict[str, int]:
    """The mesh's processes by name, as `gaas up` last wrote them."""
    return json.loads((mesh.run_dir / "mesh.json").read_text())["children"]


def wait_restarted(mesh, name: str, old_pid: int, timeout: float = 60.0) -> int:
    """The pid of `name` once `gaas up` has restarted it."""
    def restarted() -> int | None:
        pid = children(mesh).get(name)
        return pid if pid and pid != old_pid and process_alive(pid) else None

    return eventually(restarted, timeout, what=lambda: f"{name} was not restarted; gaas up said:\n"
                                                       f"{mesh.output.read_text()[-2000:]}")


def wait_serving(mesh, name: str, timeout: float = 60.0) -> None:
    """Until `name` answers its health check SERVING."""
    from gaas.ops.probe import grpc_health

    eventually(lambda: grpc_health(instance(mesh, name))[0] == "SERVING", timeout, what=f"{name} serving again")


def needs_own_mesh(mesh) -> None:
    if mesh.proc is None:
        pytest.skip("kills processes of a mesh this session started")


# ------------------------------------------------------------------ HTTP at the ingress


def send(conn, method, path, raw=None, headers=None) -> tuple[int, str]:
    """(status, body) of one request on conn, reconnecting once if the ingress closed it."""
    try:
        conn.request(method, path, body=raw, headers=headers or {})
        resp = conn.getresponse()
    except (httpclient.HTTPException, OSError):
        conn.close()
        conn.request(method, path, body=raw, headers=headers or {})
        resp = conn.getresponse()
    return resp.status, resp.read().decode("utf-8", "replace")


def error_shaped(status: int, body: str) -> None:
    """A 4xx with OpenAI's error object (message, type, code, param)."""
    assert 400 <= status < 500, f"{status}: {body[:500]}"
    error = json.loads(body)["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and isinstance(error["code"], str)
    assert error["param"] is None or isinstance(error["param"], str)

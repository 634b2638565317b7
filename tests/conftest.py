"""Shared fixtures. The expensive pieces (Redis, PostgreSQL, the whole mesh with its vLLM workers)
start once per test session and are shared; the mesh is started with the real `gaas up` command.

tests/unit mirrors the code's packages (gaas/<package>, services/<name>, bench) and needs no mesh;
tests/e2e runs against one. fakeclock, meshutil, postgres and stripefake are what both share."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings

from gaas.ops import protogen
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[1]
protogen.generate()

# Property-based tests explore the same examples on every run, so CI is repeatable; explore new
# ones with HYPOTHESIS_PROFILE=explore (what they find goes into the tests as explicit cases).
settings.register_profile("gaas", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gaas"))

MESH_WORKERS = 2
MESH_START_TIMEOUT = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_collection_modifyitems(config, items):
    # Everything under tests/e2e runs against a mesh (the session's, or one of its own): marked so,
    # for `-m "not mesh"` (make test-unit runs tests/unit alone).
    e2e = Path(__file__).resolve().parent / "e2e"
    for item in items:
        if e2e in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.mesh)
    # Tests that break the shared mesh (kill a worker, stop it) run after all others, in file order;
    # those that load the whole host (a mesh of their own as large as the shared one) after them:
    # the shared mesh's tests never run beside them.
    items.sort(key=lambda item: 2 if item.get_closest_marker("apart") else 1 if item.get_closest_marker("destructive")
               else 0)


def pytest_configure(config):
    config.addinivalue_line("markers", "destructive: damages the shared mesh; runs last")
    config.addinivalue_line("markers", "apart: loads the whole host; runs after the destructive tests")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A freshly built gaas-tiny model directory (weights, tokenizer, chat template)."""
    from gaas.model.build import build_model

    return build_model("tiny", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A private, throw-away Redis for the session."""
    from gaas.launcher.secrets import redis_answers, redis_server_command

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    proc = subprocess.Popen(
        redis_server_command("127.0.0.1", port, tmp_path_factory.mktemp("redis")),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        eventually(lambda: redis_answers(url), 10, every=0.05, what="redis-server answering")
    except pytest.fail.Exception:
        proc.kill()
        raise
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def postgres_url():
    """A PostgreSQL database for the session: the one GAAS_TEST_POSTGRES_URL names, else a throw-away
    server started here (gaas/ops/pgserver.py), never one the machine happens to run."""
    if url := os.environ.get("GAAS_TEST_POSTGRES_URL"):
        yield url
        return
    from gaas.ops.pgserver import HOW_TO_INSTALL, ThrowAwayPostgres, find_binaries

    if (bindir := find_binaries()) is None:
        pytest.skip(HOW_TO_INSTALL)
    with ThrowAwayPostgres(bindir) as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    """Each database the SQL layer supports, for tests of SQL-backed stores: a fresh SQLite file, and
    the session's PostgreSQL (shared: a test drops the tables it made)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'test.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
async def redis(redis_url):
    """A client of the session's throw-away Redis, emptied first."""
    from gaas.runtime import redisconn

    client = redisconn.connect(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


@dataclass
class RunningMesh:
    proc: subprocess.Popen
    run_dir: Path
    ingress: str
    port_base: int
    ready: dict
    # name -> pid of every child `gaas up` started (from its state file).
    children: dict[str, int]
    output: Path
    # The demo tenant's key `gaas up` created.
    api_key: str
    # The local Stripe billing reports to (None when attached to a mesh started elsewhere).
    stripe: object = None

    @property
    def auth(self) -> tuple:
        return (("authorization", f"Bearer {self.api_key}"),)

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


# The ingress path the session's mesh runs: the topology's default, direct, unless
# GAAS_TEST_INGRESS_PATH says router (`make test` runs the end-to-end half on both). Tests of what
# only one path does skip on the other (on_router_path, on_direct_path).
INGRESS_PATH = os.environ.get("GAAS_TEST_INGRESS_PATH") or "direct"


def on_router_path(why: str):
    """A mark for a test of what the router path does and the direct path cannot, saying why."""
    return pytest.mark.skipif(INGRESS_PATH == "direct", reason=f"the router path's own: {why}")


def on_direct_path(why: str):
    """A mark for a test of what only the direct path does, saying why."""
    return pytest.mark.skipif(INGRESS_PATH != "direct", reason=f"the direct path's own: {why}")


@pytest.fixture(scope="session")
def mesh(tmp_path_factory) -> RunningMesh:
    """The whole mesh, started by `gaas up` exactly as a user would (with its own Redis).

    GAAS_TEST_MESH=<run dir> points the tests at a mesh already running from that directory
    instead (for working on the tests; run them with -m "not destructive" then)."""
    from gaas.launcher.rundir import free_port_base

    if existing := os.environ.get("GAAS_TEST_MESH"):
        # In-process clients (gaas.sdk.admin, gaas.ops.probe) reach the sidecars as that mesh's operator.
        os.environ["GAAS_HOME"] = str(Path(existing).resolve())
        yield _attach(Path(existing))
        return
    from tests.meshutil import start_mesh
    from tests.stripefake import FakeStripe

    run_dir = tmp_path_factory.mktemp("mesh")
    stripe = FakeStripe("sk_test_mesh").start()
    # Billing reports to the local Stripe in 2-second windows, so tests see meter events soon.
    env = {"GAAS_STRIPE_API_KEY": stripe.api_key, "GAAS_STRIPE_API_BASE": stripe.url,
           "GAAS_STRIPE_WINDOW_SECONDS": "2", "GAAS_STRIPE_GRACE_SECONDS": "1"}
    # Every request traced, as an operator looking into one would run it (tests/e2e/test_traces.py).
    path = ["--ingress-path", INGRESS_PATH]
    m = start_mesh(run_dir, free_port_base(span=200, start=31000), "--workers", str(MESH_WORKERS), "--trace", *path,
                   timeout=MESH_START_TIMEOUT, env=env)
    m.stripe = stripe
    # In-process clients (gaas.sdk.admin, gaas.ops.probe) reach the sidecars as this mesh's operator.
    os.environ["GAAS_HOME"] = str(run_dir.resolve())
    yield m
    if m.proc.poll() is None:
        m.stop()
    stripe.stop()


def _attach(run_dir: Path) -> RunningMesh:
    from gaas.ops import probe, topology

    state = json.loads((run_dir / "mesh.json").read_text())
    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={}, port_base=state["port_base"],
                         ingress_port=state["ingress_port"], workers=state["auto_workers"])
    topo = topology.with_state_workers(topo, state["workers"])
    ready = probe.probe(topo, run_dir.resolve(), timeout=2.0).to_dict()
    ingress = f"{state['host']}:{state['ingress_port']}"
    key = (run_dir / "demo-key").read_text().strip()
    return RunningMesh(None, run_dir, ingress, state["port_base"], ready, state["children"], run_dir / "up.out", key)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False

"""The operator's life as it is lived: one run directory across starts, each start the real
`gaas up` (its own Redis and ports, one or two workers). In order, in that one directory:

  1. a run directory an older release left (the ledger's schema at its first version with a row
     in it, a state file of a `gaas up` long gone, a Unix socket left behind) is upgraded in place;
  2. stopped and started again, the mesh serves the demo key it saved the first time;
  3. a second `gaas up` while one runs is refused, naming it (and one from another directory on
     the same ports is refused, naming the ports);
  4. after `kill -9` of `gaas up` itself, the next start waits for what it left and serves, with
     the topology changed (two workers instead of one);
  5. started again with one worker and other ports, no request goes to a worker of the earlier
     topology, whose registration outlived it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, on_direct_path, process_alive
from tests.meshutil import openai_client, start_mesh
from tests.waiting import eventually

# Its meshes are its own, started on the default path whichever path the suite runs on: once per suite.
pytestmark = [pytest.mark.mesh, on_direct_path("its meshes are the default path's, the same run on either half")]

MODEL = "gaas-tiny"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """The one run directory of the whole module."""
    return tmp_path_factory.mktemp("operator")


@pytest.fixture(scope="module")
def ports():
    """Two port blocks (below the kernel's ephemeral range), for a start that moves."""
    from gaas.launcher.rundir import free_port_base

    first = free_port_base(span=200, start=27000)
    return first, free_port_base(span=200, start=first + 200)


def served(m, key=None, times: int = 1) -> None:
    c = openai_client(m, key)
    for _ in range(times):
        r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2)
        assert r.usage.completion_tokens >= 1


def gaas(home, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "gaas.cli.main", *args, "--run-dir", str(home)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={k: v for k, v in os.environ.items() if k != "GAAS_HOME"})


def _ledger_at_first_version(path) -> None:
    """billing.db as the first billing service left it: the ledger of migration 1, one row."""
    from services.billing.ledger import MIGRATIONS

    db = sqlite3.connect(path)
    for statement in MIGRATIONS[0]:
        db.execute(statement)
    db.execute("CREATE TABLE schema_migrations (component TEXT NOT NULL, version INTEGER NOT NULL, "
               "applied_ms BIGINT NOT NULL, PRIMARY KEY (component, version))")
    db.execute("INSERT INTO schema_migrations VALUES ('billing', 1, 0)")
    db.execute("INSERT INTO usage_ledger VALUES ('req-from-an-old-release', 'oldco', 'gaas-tiny', '1', 10, 0, 5, ?)",
               (int(time.time() * 1000) - 60_000,))
    db.commit()
    db.close()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_an_older_run_directory_is_upgraded_in_place(home, ports):
    _ledger_at_first_version(home / "billing.db")
    # The state file of a `gaas up` that is long gone (the format before start times were kept).
    (home / "mesh.json").write_text(json.dumps({"pid": _dead_pid(), "children": {"router-0": _dead_pid()}}))
    # A socket a killed router left behind.
    (home / "sockets" / "router-0").mkdir(parents=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(home / "sockets" / "router-0" / "service.sock"))
    s.close()

    m = start_mesh(home, ports[0], "--workers", "1")
    try:
        served(m)
        # The ledger was migrated with its row: usage reads every column of today's schema.
        r = gaas(home, "usage", "oldco", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["total"]["requests"] == 1
    finally:
        assert m.stop() == 0


def test_a_second_start_serves_the_demo_key_saved_by_the_first(home, ports):
    saved = (home / "demo-key").read_text().strip()
    m = start_mesh(home, ports[0], "--workers", "1")
    try:
        assert m.api_key == saved
        served(m, saved)
        out = (home / "gaas-up.out").read_text()
        assert "cannot set up the demo tenant" not in out
    finally:
        assert m.stop() == 0


def test_a_second_gaas_up_is_refused_naming_the_running_one(home, ports, tmp_path):
    m = start_mesh(home, ports[0], "--workers", "1")
    try:
        r = gaas(home, "up", "--port-base", str(ports[1]), "--ingress-port", str(ports[1] + 190), "--timeout", "30")
        assert r.returncode != 0
        assert f"already running from {home}" in r.stderr and f"pid {m.proc.pid}" in r.stderr, r.stderr
        other = tmp_path / "other"
        r = subprocess.run([sys.executable, "-m", "gaas.cli.main", "up", "--run-dir", str(other), "--port-base",
                            str(ports[0]), "--ingress-port", str(ports[0] + 190), "--redis-url",
                            f"redis://127.0.0.1:{ports[0] + 191}/0", "--timeout", "30"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "in use" in r.stderr, r.stderr
        served(m)  # neither disturbed the running mesh
    finally:
        assert m.stop() == 0


def test_after_kill_9_of_gaas_up_the_next_start_serves(home, ports):
    m = start_mesh(home, ports[0], "--workers", "1")
    key = m.api_key
    left = dict(m.children)
    m.proc.send_signal(signal.SIGKILL)
    m.proc.wait(timeout=10)
    # At once, as an operator would, and with the topology changed: two workers.
    m2 = start_mesh(home, ports[0], "--workers", "2")
    assert not [name for name, pid in left.items() if process_alive(pid)], "the dead gaas up's children live on"
    assert m2.api_key == key
    assert sorted(w["worker_id"] for w in m2.ready["workers"]) == ["worker-0", "worker-1"]
    served(m2, times=4)
    # Killed again, mid-life: its workers' registrations may outlive it (the next test's ghosts).
    m2.proc.send_signal(signal.SIGKILL)
    m2.proc.wait(timeout=10)


def test_a_topology_changed_between_starts_serves_only_its_own_workers(home, ports):
    from gaas.ops import topology

    # One worker, other ports: worker-1, and worker-0 at its old address, are not this mesh's.
    m = start_mesh(home, ports[1], "--workers", "1")
    try:
        topo = topology.load(ROOT / "deploy" / "topology.yaml", env={}, port_base=ports[1],
                             ingress_port=ports[1] + 190, workers=1)
        ours = [(w.name, w.inbound) for w in topo.of("worker")]
        # Ready once its own worker is registered, whatever an earlier topology's registrations say.
        assert set(ours) <= {(w["worker_id"], w["address"]) for w in m.ready["workers"] if w["state"] == "SERVING"}
        c = openai_client(m)
        for _ in range(12):
            r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2)
            assert r.usage.completion_tokens >= 1
        def listed() -> list:
            return [(w["worker_id"], w["address"]) for w in json.loads(gaas(home, "status", "--json").stdout)["workers"]]

        # What the earlier topology registered lapses within a lease.
        eventually(lambda: listed() == ours, 15, every=1,
                   what=lambda: f"only this topology's workers registered (listed: {listed()})")
    finally:
        assert m.stop() == 0

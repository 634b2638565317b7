"""The ingress's readiness (gaas.ops.probe.ingress_ready), read from its admin's /clusters: a
healthy router, and on the direct path every registered worker known to its workers cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from gaas.ops import probe

CLUSTERS = """router::127.0.0.1:20041::health_flags::healthy
router_authz::127.0.0.1:20041::health_flags::healthy
workers::127.0.0.1:20061::health_flags::healthy
"""


@pytest.fixture
def admin(monkeypatch):
    monkeypatch.setattr(probe, "envoy_ready", lambda admin, timeout: True)
    monkeypatch.setattr(probe, "envoy_admin", lambda admin, path, timeout: (200, CLUSTERS.encode()))
    return Path("/nowhere/admin.sock")


def test_the_ingress_is_ready_once_it_knows_every_registered_worker(admin):
    assert probe.ingress_ready(admin, workers=["127.0.0.1:20061"])
    assert probe.ingress_ready(admin)


def test_a_worker_its_xds_has_not_brought_yet_keeps_the_ingress_unready(admin):
    assert not probe.ingress_ready(admin, workers=["127.0.0.1:20061", "127.0.0.1:20071"])


def test_a_routers_sidecar_knows_the_workers_its_xds_has_brought(admin, monkeypatch):
    """(CI saw a router-path mesh's first requests answered 503 no_healthy_upstream: its router's
    sidecar had not yet been told of the workers that had just registered; gaas up waits for it)"""
    assert probe.knows_workers(admin, ["127.0.0.1:20061"])
    assert probe.knows_workers(admin, [])
    assert not probe.knows_workers(admin, ["127.0.0.1:20061", "127.0.0.1:20071"])
    monkeypatch.setattr(probe, "envoy_admin", lambda admin, path, timeout: (503, b""))
    assert not probe.knows_workers(admin, ["127.0.0.1:20061"])

"""Fixtures of the end-to-end modules beyond the mesh's own (tests/conftest.py)."""

from __future__ import annotations

import http.client as httpclient

import pytest


@pytest.fixture(scope="module")
def conn(mesh):
    """One HTTP/1.1 connection to the ingress for a module's many small requests
    (tests.e2e.support.send reconnects it when the ingress closed it)."""
    host, port = mesh.ingress.split(":")
    c = httpclient.HTTPConnection(host, int(port), timeout=60)
    yield c
    c.close()

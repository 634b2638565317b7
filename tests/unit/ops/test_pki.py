"""The mesh's CA and identities (gaas/ops/pki.py) and control's rule that a worker registers only itself."""

import os
import stat
from urllib.parse import quote

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtensionOID
from hypothesis import given
from hypothesis import strategies as st

from gaas.contracts import identity
from gaas.contracts import errors
from gaas.ops import pki
from gaas.runtime.context import caller_var
from services.control.servicer import _only_the_worker_itself


def _sans(path):
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    ext = cert.extensions.get_extension_for_oid(ExtensionOID.SUBJECT_ALTERNATIVE_NAME).value
    return ext.get_values_for_type(x509.UniformResourceIdentifier), ext.get_values_for_type(x509.DNSName), cert


def test_the_ca_is_kept_and_every_private_key_is_the_owners_alone(tmp_path):
    authority = pki.Authority(tmp_path)
    authority.ensure()
    ca = authority.ca_cert.read_bytes()
    authority.ensure()
    assert authority.ca_cert.read_bytes() == ca, "a second start must keep the CA (issued certificates stay valid)"
    creds = authority.issue("worker", "worker-3", sidecar="127.0.0.1:20041")
    assert stat.S_IMODE(os.stat(authority.dir).st_mode) == 0o700
    for key in (authority.ca_key, creds.key):
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600, key


def test_an_identity_is_the_first_uri_and_a_worker_names_its_sidecar(tmp_path):
    authority = pki.Authority(tmp_path)
    authority.ensure()
    uris, dns, cert = _sans(authority.issue("worker", "worker-3", sidecar="127.0.0.1:20041").cert)
    assert uris == ["spiffe://gaas.local/worker/worker-3", "gaas-sidecar://127.0.0.1:20041"]
    assert dns == [identity.SERVER_NAME]
    ca = x509.load_pem_x509_certificate(authority.ca_cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    uris, _, _ = _sans(authority.issue(*pki.OPERATOR).cert)
    assert uris == ["spiffe://gaas.local/operator/cli"]


def _xfcc(*uris: str) -> str:
    return "By=spiffe://gaas.local/control/control-0;Hash=abc;" + ";".join(f"URI={quote(u, safe=':/')}" for u in uris)


def test_the_caller_is_read_from_what_the_sidecar_verified():
    c = identity.caller_from_xfcc(_xfcc("spiffe://gaas.local/worker/worker-1", "gaas-sidecar://127.0.0.1:20051"))
    assert (c.kind, c.name, c.sidecar) == ("worker", "worker-1", "127.0.0.1:20051")
    assert identity.caller_from_xfcc("") is None
    assert identity.caller_from_xfcc("Hash=abc;URI=https://elsewhere/worker/worker-1") is None


@given(st.text(max_size=200))
def test_any_header_parses_to_a_caller_or_none(value):
    c = identity.caller_from_xfcc(value)
    assert c is None or c.identity.startswith(identity.MESH_PREFIX)


@pytest.mark.parametrize("xfcc, worker, address, allowed", [
    (_xfcc("spiffe://gaas.local/worker/worker-1", "gaas-sidecar://127.0.0.1:20051"), "worker-1", "127.0.0.1:20051", True),
    (_xfcc("spiffe://gaas.local/worker/worker-1", "gaas-sidecar://127.0.0.1:20051"), "worker-1", None, True),
    # Another worker's id, another address, another kind, no sidecar at all.
    (_xfcc("spiffe://gaas.local/worker/worker-0", "gaas-sidecar://127.0.0.1:20041"), "worker-1", "127.0.0.1:20041", False),
    (_xfcc("spiffe://gaas.local/worker/worker-1", "gaas-sidecar://127.0.0.1:20051"), "worker-1", "10.0.0.9:443", False),
    (_xfcc("spiffe://gaas.local/operator/cli"), "worker-1", "127.0.0.1:20051", False),
    ("", "worker-1", "127.0.0.1:20051", False),
])
def test_a_worker_registers_renews_and_leaves_only_as_itself(xfcc, worker, address, allowed):
    token = caller_var.set(xfcc)
    try:
        if allowed:
            _only_the_worker_itself(worker, address)
        else:
            with pytest.raises(errors.PermissionDenied, match="worker-1"):
                _only_the_worker_itself(worker, address)
    finally:
        caller_var.reset(token)

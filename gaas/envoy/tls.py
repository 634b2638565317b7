"""Transport sockets: every hop between Envoys is mutual TLS with the mesh's own CA (gaas/ops/pki.py),
and the ingress may serve TLS with a certificate of its own."""

from __future__ import annotations

from pathlib import Path

from gaas.contracts import identity
from gaas.ops import pki


def certificate(cert: Path, key: Path) -> dict:
    return {"certificate_chain": {"filename": str(cert)}, "private_key": {"filename": str(key)}}


def downstream_tls(cert: Path, key: Path, alpn: list[str], client_ca: Path | None = None) -> dict:
    """A listener's TLS with this certificate; with client_ca, callers must present a certificate
    it signed."""
    context: dict = {"tls_certificates": [certificate(cert, key)], "alpn_protocols": alpn}
    tls: dict = {"@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"}
    if client_ca is not None:
        context["validation_context"] = {"trusted_ca": {"filename": str(client_ca)}}
        tls["require_client_certificate"] = True
    return {"name": "envoy.transport_sockets.tls", "typed_config": {**tls, "common_tls_context": context}}


def server_tls(creds: pki.Credentials) -> dict:
    """An inbound listener's mutual TLS: the instance's certificate, and callers must present one
    the mesh's CA signed."""
    return downstream_tls(creds.cert, creds.key, ["h2"], client_ca=creds.ca)


def client_tls(creds: pki.Credentials, peer_kind: str) -> dict:
    """A cluster's mutual TLS: present this identity, and accept only a peer of peer_kind."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": identity.SERVER_NAME,
            "common_tls_context": {
                "tls_certificates": [certificate(creds.cert, creds.key)],
                "validation_context": {
                    "trusted_ca": {"filename": str(creds.ca)},
                    "match_typed_subject_alt_names": [
                        {"san_type": "URI", "matcher": {"prefix": identity.kind_prefix(peer_kind)}}
                    ],
                },
                "alpn_protocols": ["h2"],
            },
        },
    }

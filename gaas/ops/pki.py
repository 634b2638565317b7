"""The mesh's own certificate authority, for mutual TLS between every sidecar.

`gaas up` keeps one CA per run directory (pki/ca.crt, its key 0600) and issues a certificate to each
identity of the mesh before starting it: every service instance, the ingress, and the operator (the
`gaas` CLI). An identity is a URI in the certificate's first subject alternative name,
spiffe://gaas.local/<kind>/<name>; Envoy's RBAC filters allow a caller by that name, and a worker's
certificate also names its own sidecar's address (gaas-sidecar://host:port) so control can check
that a worker registers only itself, at its own address.

Servers also carry DNS:gaas.local, the name clients ask for (a mesh address is host:port, and the
same certificate serves whatever host the topology binds).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gaas.contracts.identity import SERVER_NAME, SIDECAR_SCHEME, TRUST_DOMAIN, spiffe_id

if TYPE_CHECKING:
    from gaas.ops.topology import Topology

PKI_DIR = "pki"

CA_DAYS = 3650
LEAF_DAYS = 365


OPERATOR = ("operator", "cli")
INGRESS = ("ingress", "ingress-0")


@dataclass(frozen=True, slots=True)
class Credentials:
    """Where one identity's certificate, key and the CA that signed it are."""

    cert: Path
    key: Path
    ca: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        return self.ca.read_bytes(), self.key.read_bytes(), self.cert.read_bytes()


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


class Authority:
    """The CA of one run directory: created once, then reused (certificates it issued stay valid
    across restarts of the mesh)."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = Path(run_dir) / PKI_DIR
        self.ca_cert = self.dir / "ca.crt"
        self.ca_key = self.dir / "ca.key"

    def ensure(self) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        if self.ca_cert.exists() and self.ca_key.exists():
            cert = x509.load_pem_x509_certificate(self.ca_cert.read_bytes())
            if cert.not_valid_after_utc > _now() + datetime.timedelta(days=LEAF_DAYS):
                return
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "GaaS mesh CA"),
                          x509.NameAttribute(NameOID.ORGANIZATION_NAME, TRUST_DOMAIN)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - datetime.timedelta(minutes=5))
            .not_valid_after(_now() + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256())
        )
        _write_private(self.ca_key, key.private_bytes(serialization.Encoding.PEM,
                                                      serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
        self.ca_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def credentials(self, kind: str, name: str) -> Credentials:
        return Credentials(self.dir / f"{kind}.{name}.crt", self.dir / f"{kind}.{name}.key", self.ca_cert)

    def issue(self, kind: str, name: str, sidecar: str = "") -> Credentials:
        """A fresh certificate for spiffe://gaas.local/<kind>/<name> (client and server use); a
        worker's names its sidecar's address too."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        ca_key = serialization.load_pem_private_key(self.ca_key.read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate(self.ca_cert.read_bytes())
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(spiffe_id(kind, name))]
        if sidecar:
            sans.append(x509.UniformResourceIdentifier(SIDECAR_SCHEME + sidecar))
        sans.append(x509.DNSName(SERVER_NAME))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{kind}/{name}")]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - datetime.timedelta(minutes=5))
            .not_valid_after(_now() + datetime.timedelta(days=LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        creds = self.credentials(kind, name)
        _write_private(creds.key, key.private_bytes(serialization.Encoding.PEM,
                                                    serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
        creds.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return creds


def issue_certificates(topo: Topology, authority: Authority) -> None:
    """The CA (kept) and a fresh certificate for every identity the mesh's Envoy configs name: each
    instance (a worker's names its sidecar's address), the ingress and the operator."""
    authority.ensure()
    for inst in topo.instances:
        authority.issue(inst.service, inst.name, sidecar=inst.inbound if inst.service == "worker" else "")
    authority.issue(*INGRESS)
    authority.issue(*OPERATOR)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def home() -> Path:
    """The run directory whose CA and operator certificate the CLI uses: $GAAS_HOME, else .gaas."""
    env = os.environ.get("GAAS_HOME")
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".gaas"


def channel(address: str, creds: Credentials, *, aio: bool = False):
    """A mutual-TLS gRPC channel to a sidecar's inbound listener, as the identity of creds."""
    import grpc

    ca, key, cert = creds.read()
    tls = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    module = grpc.aio if aio else grpc
    return module.secure_channel(address, tls, options=[("grpc.ssl_target_name_override", SERVER_NAME)])


def operator_channel(address: str, run_dir: Path | None = None, *, aio: bool = False):
    """A gRPC channel to a sidecar's inbound listener as the operator (the identity the `gaas` CLI
    presents). Without the mesh's CA (a mesh never started from this run directory) the channel is
    plaintext, which sidecars refuse: the caller's "does not answer" error says to check the mesh."""
    import grpc

    creds = Authority(run_dir or home()).credentials(*OPERATOR)
    if not creds.cert.exists():
        return (grpc.aio if aio else grpc).insecure_channel(address)
    return channel(address, creds, aio=aio)

"""The ingress on Kubernetes, the mesh's one door to its clients: Envoy alone (gaas/envoy/ingress.py),
two replicas or more behind a LoadBalancer Service, serving HTTPS on 443 (HTTP/2 offered by ALPN,
for gRPC clients) with the certificate of a kubernetes.io/tls Secret, plain HTTP on 80 only when the
render is told so (Edge.plaintext; the Deployment then says it, and the rules check that nothing
else is plaintext).

The certificate: cert-manager's, when an issuer is named (a Certificate is rendered that writes the
Secret); else the render's secrets hold a trial one (trial_certificate: a CA of its own and a
certificate for the Service's names and Edge.hosts) that an operator replaces with theirs.

The client's address: the Service keeps it (externalTrafficPolicy: Local: no second hop through
another node, so no source NAT), and behind a cloud load balancer the ingress believes what
Edge.xff_trusted_hops balancers append to X-Forwarded-For, or the PROXY protocol (Edge.proxy_protocol);
the key check's limiter keys on the result (edge.CLIENT_ADDRESS_HEADER)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass, replace
from pathlib import Path

from gaas.envoy import config as envoyconf
from gaas.k8s import manifests as m
from gaas.k8s import pods, rules
from gaas.launcher.mesh import INGRESS_DRAIN_SECONDS
from gaas.ops.topology import Topology

# Says on the ingress Deployment that its plaintext listener was asked for (the rules check it).
PLAINTEXT_ANNOTATION = rules.PLAINTEXT_ANNOTATION
# The trial certificate's files in the render's secrets directory.
TRIAL_CA, TRIAL_CA_KEY = "ingress-ca.crt", "ingress-ca.key"
TRIAL_CERT, TRIAL_KEY = "ingress-tls.crt", "ingress-tls.key"
TRIAL_DAYS = 365


@dataclass(frozen=True, slots=True)
class Edge:
    """How clients reach the ingress: what an operator chooses when rendering."""

    # The kubernetes.io/tls Secret (tls.crt, tls.key) the ingress serves HTTPS with.
    tls_secret: str = f"{pods.PREFIX}-edge-tls"
    # cert-manager's issuer of that certificate ("ClusterIssuer/NAME" or "Issuer/NAME"); "" none:
    # the render's secrets hold a trial certificate under tls_secret's name.
    issuer: str = ""
    # The names clients reach the ingress by (the certificate's, besides the Service's own).
    hosts: tuple[str, ...] = ()
    # True: plain HTTP on port 80 (behind something of the operator's that terminates TLS).
    plaintext: bool = False
    # Load balancers in front of the ingress that append the address they saw to X-Forwarded-For,
    # trusted to (a cloud's HTTP load balancer: 1); 0: the connection's address is the client's.
    xff_trusted_hops: int = 0
    # The load balancer sends the PROXY protocol first (a network load balancer set to).
    proxy_protocol: bool = False

    @property
    def port(self) -> int:
        """The ingress container's port."""
        return pods.INGRESS_PORT if self.plaintext else pods.INGRESS_TLS_PORT

    def dns_names(self, namespace: str) -> list[str]:
        """The certificate's names: the operator's, then the Service's own in the cluster."""
        own = [pods.INGRESS, f"{pods.INGRESS}.{namespace}.svc", f"{pods.INGRESS}.{namespace}.svc.cluster.local"]
        return list(dict.fromkeys([*self.hosts, *own]))

    def issuer_ref(self) -> dict:
        kind, _, name = self.issuer.partition("/")
        if kind not in ("ClusterIssuer", "Issuer") or not name:
            raise ValueError(f"the certificate's issuer is {self.issuer!r}: write ClusterIssuer/NAME or Issuer/NAME")
        return {"group": "cert-manager.io", "kind": kind, "name": name}


def ingress_objects(topo: Topology, descriptor: str, edge: Edge, namespace: str) -> list[dict]:
    """The ingress's ServiceAccount, Envoy config, Deployment, LoadBalancer Service, statistics
    Service, PodDisruptionBudget, autoscaler and, when cert-manager issues it, its Certificate."""
    name = pods.INGRESS
    tls = None if edge.plaintext else (Path(pods.EDGE_TLS_DIR) / "tls.crt", Path(pods.EDGE_TLS_DIR) / "tls.key")
    # (The listener on the ingress's port: HTTPS's, or plain HTTP's.)
    config = envoyconf.ingress_config(replace(topo, ingress_port=edge.port), Path(descriptor), Path(pods.LOG_DIR), pods.authority(), tls,
                                      Path(pods.SOCKETS_DIR), xff_trusted_hops=edge.xff_trusted_hops,
                                      proxied=edge.proxy_protocol)
    envoy = m.envoy_container("ingress-0", "ingress-0", m.RESOURCES["ingress"], sidecar=False)
    scheme = "http" if edge.plaintext else "https"
    envoy["ports"].insert(0, {"name": scheme, "containerPort": edge.port})
    envoy["readinessProbe"] = m.http_probe(pods.ENVOY_STATS_PORT, "/metrics", period=2, failures=2)
    volumes = [v for v in m.pod_volumes(name, deploy=False) if v["name"] in ("envoy", "pki", "sockets", "logs")]
    if not edge.plaintext:
        envoy["volumeMounts"].append(m.mount("edge-tls", pods.EDGE_TLS_DIR, True))
        volumes.append({"name": "edge-tls", "secret": {"secretName": edge.tls_secret, "defaultMode": 0o440}})
    dep = m.deployment(name, "ingress", [envoy], [], replicas=2, grace=int(INGRESS_DRAIN_SECONDS) + 5, volumes=volumes)
    # With externalTrafficPolicy Local only nodes that run an ingress pod take traffic: spread them.
    dep["spec"]["template"]["spec"]["topologySpreadConstraints"] = [{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": m.selector(name)}}]
    if edge.plaintext:
        dep["metadata"]["annotations"] = {PLAINTEXT_ANNOTATION: "true"}
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": m.meta(name, "ingress"),
           "spec": {"type": "LoadBalancer", "selector": m.selector(name),
                    # Straight to a local ingress pod, the client's address kept (no source NAT).
                    "externalTrafficPolicy": "Local",
                    "ports": [{"name": scheme, "port": 80 if edge.plaintext else 443, "targetPort": edge.port}]}}
    stats = m.headless_service(f"{name}-stats", "ingress", [("envoy-stats", pods.ENVOY_STATS_PORT)])
    stats["spec"]["selector"] = m.selector(name)
    out = [m.service_account(name, "ingress"), m.envoy_configmap(name, "ingress", config), dep, svc, stats,
           m.pdb(name, "ingress", {"minAvailable": 1}), m.hpa(name, "ingress", 2, 8)]
    if edge.issuer and not edge.plaintext:
        out.append(certificate(edge, namespace))
    return out


def certificate(edge: Edge, namespace: str) -> dict:
    """cert-manager's Certificate that writes (and renews) the ingress's Secret."""
    return {"apiVersion": "cert-manager.io/v1", "kind": "Certificate", "metadata": m.meta(pods.INGRESS, "ingress"),
            "spec": {"secretName": edge.tls_secret, "dnsNames": edge.dns_names(namespace),
                     "issuerRef": edge.issuer_ref(), "privateKey": {"algorithm": "ECDSA", "size": 256}}}


def trial_certificate(d: Path, names: list[str]) -> None:
    """A certificate for names (and 127.0.0.1, for a port-forward) in d, signed by a CA of its own
    (TRIAL_CA: what a client is told to trust), both made once and kept; the certificate is made
    again when names change, unless it is an operator's own (not signed by that CA)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    pem = serialization.Encoding.PEM

    def key_bytes(key) -> bytes:
        return key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    if not (d / TRIAL_CA).exists():
        ca_key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "GaaS ingress trial CA")])
        ca = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(ca_key.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
              .not_valid_after(now + datetime.timedelta(days=10 * TRIAL_DAYS))
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .sign(ca_key, hashes.SHA256()))
        _private(d / TRIAL_CA_KEY, key_bytes(ca_key))
        (d / TRIAL_CA).write_bytes(ca.public_bytes(pem))
        (d / TRIAL_CERT).unlink(missing_ok=True)
    ca = x509.load_pem_x509_certificate((d / TRIAL_CA).read_bytes())
    sans = [*(x509.DNSName(n) for n in names), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    if (d / TRIAL_CERT).exists():
        have = x509.load_pem_x509_certificate((d / TRIAL_CERT).read_bytes())
        if have.issuer != ca.subject:
            return  # (the operator's own)
        named = have.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        if set(named) == set(sans) and have.not_valid_after_utc > now + datetime.timedelta(days=30):
            return
    ca_key = serialization.load_pem_private_key((d / TRIAL_CA_KEY).read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=TRIAL_DAYS))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _private(d / TRIAL_KEY, key_bytes(key))
    (d / TRIAL_CERT).write_bytes(cert.public_bytes(pem))


def _private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)

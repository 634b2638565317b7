"""Who is who in the mesh: the identities the CA (gaas/ops/pki.py) writes into certificates and
the receiving sidecars verify. An identity is a URI, spiffe://gaas.local/<kind>/<name>, in the
certificate's first subject alternative name; a worker's also names its own sidecar's address
(gaas-sidecar://host:port). A service reads its verified caller from the x-forwarded-client-cert
header its sidecar sets (gaas.runtime.context.current_caller). Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

TRUST_DOMAIN = "gaas.local"
SERVER_NAME = TRUST_DOMAIN
SIDECAR_SCHEME = "gaas-sidecar://"


def spiffe_id(kind: str, name: str) -> str:
    return f"spiffe://{TRUST_DOMAIN}/{kind}/{name}"


def kind_prefix(kind: str) -> str:
    """What every identity of one kind begins with (Envoy matches callers by it)."""
    return f"spiffe://{TRUST_DOMAIN}/{kind}/"


MESH_PREFIX = f"spiffe://{TRUST_DOMAIN}/"


@dataclass(frozen=True, slots=True)
class Caller:
    """Who called, as the receiving sidecar verified it: the identity URI and, for a worker, the
    address of its sidecar."""

    identity: str
    sidecar: str = ""
    # The address its connection came from (what the receiving sidecar saw; "" unknown).
    peer: str = ""

    def at(self, peer: str) -> "Caller":
        return Caller(self.identity, self.sidecar, peer)

    def may_register(self, worker_id: str, address: str | None = None) -> bool:
        """Whether this caller may register (at address, when given), renew or deregister worker
        worker_id. A worker's own certificate (`gaas up` issues one per worker) names its id and
        its sidecar's address; a pool's (Kubernetes: one per worker Deployment, whose pods are
        named after it) names the Deployment, and its workers register at the address their
        connection comes from."""
        if self.kind != "worker":
            return False
        if self.sidecar:
            return self.name == worker_id and (address is None or address == self.sidecar)
        if not (self.name and worker_id.startswith(self.name + "-")):
            return False
        return address is None or (bool(self.peer) and address.rpartition(":")[0].strip("[]") == self.peer)

    @property
    def kind(self) -> str:
        return self.identity.removeprefix(MESH_PREFIX).split("/", 1)[0] if self.identity.startswith(MESH_PREFIX) else ""

    @property
    def name(self) -> str:
        rest = self.identity.removeprefix(MESH_PREFIX)
        return rest.split("/", 1)[1] if "/" in rest and self.identity.startswith(MESH_PREFIX) else ""


def caller_from_xfcc(value: str) -> Caller | None:
    """The caller named by the sidecar's x-forwarded-client-cert (the sidecar replaces whatever a
    client sent with what it verified, so only the last element counts); None without one."""
    if not value:
        return None
    element = value.split(",")[-1]
    uris = [unquote(part.split("=", 1)[1].strip('"')) for part in element.split(";")
            if part.split("=", 1)[0].strip().lower() == "uri" and "=" in part]
    identity = next((u for u in uris if u.startswith(MESH_PREFIX)), "")
    if not identity:
        return None
    sidecar = next((u.removeprefix(SIDECAR_SCHEME) for u in uris if u.startswith(SIDECAR_SCHEME)), "")
    return Caller(identity, sidecar)

"""Operator calls to the control plane (tenants, API keys), made through control's sidecar.
Used by `gaas tenant ...`, `gaas key ...` and by `gaas up` for the demo tenant."""

from __future__ import annotations

import os
from pathlib import Path

import grpc

from gaas import errors
from gaas.errors import GaasError
from gaas.runtime.status import from_rpc
from gaas.tenancy import TIER_FROM_PB, TIER_TO_PB
from gaas.v1 import control_pb2 as pb
from gaas.v1 import control_pb2_grpc

TIMEOUT = 5.0
DEMO_TENANT = "demo"
DEMO_KEY_FILE = "demo-key"


def _tenant(t: pb.Tenant) -> dict:
    return {"name": t.name, "tier": TIER_FROM_PB.get(t.tier, "bronze"), "created_unix_ms": t.created_unix_ms}


def _key(k: pb.ApiKey) -> dict:
    return {
        "key_id": k.key_id,
        "tenant": k.tenant,
        "prefix": k.prefix,
        "created_unix_ms": k.created_unix_ms,
        "revoked": bool(k.revoked_unix_ms),
        "revoked_unix_ms": k.revoked_unix_ms,
    }


def _prefix(p: pb.PublicPrefix) -> dict:
    return {"prefix_id": p.prefix_id, "model": p.model, "text": p.text, "created_unix_ms": p.created_unix_ms}


class Admin:
    def __init__(self, control_address: str) -> None:
        self.address = control_address
        self._channel = grpc.insecure_channel(control_address)
        self._stub = control_pb2_grpc.ControlStub(self._channel)

    def _call(self, method: str, request):
        try:
            return getattr(self._stub, method)(request, timeout=TIMEOUT)
        except grpc.RpcError as exc:
            err = from_rpc(exc)
            if err.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                raise errors.Unavailable(f"the control plane at {self.address} does not answer: is the mesh up?") from None
            raise err from None

    def create_tenant(self, name: str, tier: str) -> dict:
        if tier not in TIER_TO_PB:
            raise errors.InvalidArgument(f"tier must be one of {', '.join(TIER_TO_PB)}", param="tier")
        return _tenant(self._call("CreateTenant", pb.CreateTenantRequest(name=name, tier=TIER_TO_PB[tier])))

    def list_tenants(self) -> list[dict]:
        return [_tenant(t) for t in self._call("ListTenants", pb.ListTenantsRequest()).tenants]

    def create_key(self, tenant: str) -> tuple[dict, str]:
        resp = self._call("CreateApiKey", pb.CreateApiKeyRequest(tenant=tenant))
        return _key(resp.key), resp.api_key

    def list_keys(self, tenant: str = "") -> list[dict]:
        return [_key(k) for k in self._call("ListApiKeys", pb.ListApiKeysRequest(tenant=tenant)).keys]

    def revoke_key(self, key_id: str) -> dict:
        return _key(self._call("RevokeApiKey", pb.RevokeApiKeyRequest(key_id=key_id)))

    def add_public_prefix(self, model: str, text: str) -> dict:
        return _prefix(self._call("AddPublicPrefix", pb.AddPublicPrefixRequest(model=model, text=text)))

    def list_public_prefixes(self, model: str = "") -> list[dict]:
        return [_prefix(p) for p in self._call("ListPublicPrefixes", pb.ListPublicPrefixesRequest(model=model)).prefixes]

    def remove_public_prefix(self, prefix_id: str) -> None:
        self._call("RemovePublicPrefix", pb.RemovePublicPrefixRequest(prefix_id=prefix_id))

    def key_works(self, api_key: str) -> bool:
        try:
            self._call("Authenticate", pb.AuthenticateRequest(api_key=api_key))
            return True
        except GaasError as err:
            if err.code == "UNAUTHENTICATED":
                return False
            raise

    def ensure_demo_key(self, run_dir: Path) -> tuple[str, bool]:
        """The local demo tenant's key, saved in run_dir (created on first use): (key, created)."""
        path = Path(run_dir) / DEMO_KEY_FILE
        if path.exists():
            key = path.read_text().strip()
            if key and self.key_works(key):
                return key, False
        try:
            self.create_tenant(DEMO_TENANT, "gold")
        except GaasError as err:
            if err.code != "ALREADY_EXISTS":
                raise
        _, key = self.create_key(DEMO_TENANT)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # readable by its owner only
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        return key, True

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Admin":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

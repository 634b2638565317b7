"""Operator calls to the control plane (tenants, API keys, the deployment and its roll-outs) and to
billing (usage, budgets, invoices), made through each service's sidecar. Used by `gaas tenant ...`,
`gaas key ...`, `gaas apply`, `gaas diff`, `gaas rollout ...`, `gaas models`, `gaas usage`, `gaas
budget`, `gaas invoice` and by `gaas up` for the demo tenant."""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc

from gaas.contracts import errors, pricing
from gaas.ops import pki
from gaas.contracts.errors import GaasError
from gaas.runtime import status
from gaas.contracts.tenancy import DEFAULT_TIER, TIER_FROM_PB, TIER_TO_PB
from gaas.v1 import billing_pb2 as billing_pb
from gaas.v1 import billing_pb2_grpc
from gaas.v1 import control_pb2 as pb
from gaas.v1 import control_pb2_grpc

TIMEOUT = 5.0
DEMO_TENANT = "demo"
DEMO_KEY_FILE = "demo-key"


def _tenant(t: pb.Tenant) -> dict:
    return {
        "name": t.name, "tier": TIER_FROM_PB.get(t.tier, DEFAULT_TIER), "created_unix_ms": t.created_unix_ms,
        "stripe_customer": t.stripe_customer,
        "limits": {"rpm": t.limits.rpm, "tpm": t.limits.tpm, "concurrency": t.limits.concurrency},
        "own_limits": list(t.own_limits),
    }


def _key(k: pb.ApiKey) -> dict:
    return {
        "key_id": k.key_id,
        "tenant": k.tenant,
        "prefix": k.prefix,
        "created_unix_ms": k.created_unix_ms,
        "revoked": bool(k.revoked_unix_ms),
        "revoked_unix_ms": k.revoked_unix_ms,
    }


def _adapter(a: pb.Adapter) -> dict:
    out = {"name": a.name, "base_model": a.base_model, "path": a.path, "rank": a.rank, "owner": a.owner,
           "public": a.public, "adapter_id": a.adapter_id, "created_unix_ms": a.created_unix_ms}
    if a.HasField("price_input"):
        out["price"] = {"input": a.price_input, "cached_input": a.price_cached_input, "output": a.price_output}
    return out


def _prefix(p: pb.PublicPrefix) -> dict:
    return {"prefix_id": p.prefix_id, "model": p.model, "text": p.text, "created_unix_ms": p.created_unix_ms}


class _Service:
    """A blocking stub to one service's sidecar; its errors are GaasErrors."""

    WHAT = ""

    def __init__(self, address: str, stub_class, run_dir: Path | None = None) -> None:
        """run_dir: the mesh's, whose operator certificate to call as (default: GAAS_HOME's)."""
        self.address = address
        self._channel = pki.operator_channel(address, run_dir)
        self._stub = stub_class(self._channel)

    def _call(self, method: str, request):
        try:
            return getattr(self._stub, method)(request, timeout=TIMEOUT)
        except grpc.RpcError as exc:
            # What the service answered is for the operator, all but silence.
            raise status.from_peer(exc, self.WHAT, passes=status.ALL_CODES - status.UNANSWERED,
                                   message=f"{self.WHAT} at {self.address} does not answer: is the mesh up?") from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Admin(_Service):
    WHAT = "the control plane"

    def __init__(self, control_address: str, run_dir: Path | None = None) -> None:
        super().__init__(control_address, control_pb2_grpc.ControlStub, run_dir)

    def create_tenant(self, name: str, tier: str) -> dict:
        if tier not in TIER_TO_PB:
            raise errors.InvalidArgument(f"tier must be one of {', '.join(TIER_TO_PB)}", param="tier")
        return _tenant(self._call("CreateTenant", pb.CreateTenantRequest(name=name, tier=TIER_TO_PB[tier])))

    def update_tenant(
        self, name: str, tier: str | None = None, stripe_customer: str | None = None,
        limits: dict[str, int | None] | None = None,
    ) -> dict:
        """Change a tenant's tier, Stripe customer ("" removes it) and/or quotas (name -> value, 0
        unlimited, None back to its tier's); what is not given stays as it is."""
        request = pb.UpdateTenantRequest(name=name)
        for key, value in (limits or {}).items():
            setattr(request, key, -1 if value is None else value)
        if tier is not None:
            if tier not in TIER_TO_PB:
                raise errors.InvalidArgument(f"tier must be one of {', '.join(TIER_TO_PB)}", param="tier")
            request.tier = TIER_TO_PB[tier]
        if stripe_customer is not None:
            request.stripe_customer = stripe_customer
        return _tenant(self._call("UpdateTenant", request))

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

    def add_adapter(self, name: str, base_model: str, path: str, owner: str = "",
                    price: tuple[float, float, float] | None = None) -> dict:
        """A LoRA adapter on base_model, a tenant's (owner) or public (owner empty)."""
        a = pb.Adapter(name=name, base_model=base_model, path=path, owner=owner, public=not owner)
        if price is not None:
            a.price_input, a.price_cached_input, a.price_output = price
        return _adapter(self._call("AddAdapter", pb.AddAdapterRequest(adapter=a)))

    def list_adapters(self, base_model: str = "") -> list[dict]:
        return [_adapter(a) for a in self._call("ListAdapters", pb.ListAdaptersRequest(base_model=base_model)).adapters]

    def remove_adapter(self, name: str) -> None:
        self._call("RemoveAdapter", pb.RemoveAdapterRequest(name=name))

    # ------------------------------------------------------------ the deployment

    def apply_deployment(self, text: str, file: str, origin: str, dry_run: bool = False) -> dict:
        """{"revision": N (0: nothing changed, or a dry run), "changes": [{subject, kind, detail}]}."""
        resp = self._call("ApplyDeployment", pb.ApplyDeploymentRequest(text=text, file=file, origin=origin,
                                                                       dry_run=dry_run))
        return {"revision": resp.revision,
                "changes": [{"subject": c.subject, "kind": c.kind, "detail": c.detail} for c in resp.changes]}

    def revisions(self, model: str = "") -> list[dict]:
        return [{"number": r.number, "applied_unix_ms": r.applied_unix_ms, "origin": r.origin,
                 "changes": list(r.changes), "digest": r.digest}
                for r in self._call("ListRevisions", pb.ListRevisionsRequest(model=model)).revisions]

    def models(self) -> list[dict]:
        """The deployment's models: stable version, replicas, the versions with workers, the split."""
        out = []
        for m in self._call("ListModels", pb.ListRegisteredModelsRequest()).models:
            s = m.split
            out.append({
                "name": m.name, "version": m.version, "is_default": m.is_default, "replicas": m.replicas or "0",
                "max_model_len": m.max_model_len, "source": m.source, "task": m.task or "generate",
                "versions": [{"version": v.version, "role": v.role, "source": v.source, "tenants": list(v.tenants)}
                             for v in m.versions],
                "split": {"stable": s.stable, "canary": s.canary, "weight": s.weight, "shadow": s.shadow,
                          "pins": dict(s.pins), "kept": list(s.kept)},
            })
        return out

    def pools(self) -> list[dict]:
        return [{"model": p.model, "version": p.version, "role": p.role, "replicas": p.replicas, "source": p.source,
                 "device": p.device, "device_needs": json.loads(p.device_needs_json or "{}"),
                 "engine": json.loads(p.engine_json or "{}"),
                 **({"autoscale": {"min": p.min_replicas, "max": p.max_replicas, "reason": p.scale_reason}}
                    if p.autoscaled else {})}
                for p in self._call("ListPools", pb.ListPoolsRequest()).pools]

    def rollout(self, model: str) -> dict:
        return json.loads(self._call("GetRollout", pb.GetRolloutRequest(model=model)).json)

    def change_rollout(self, model: str, action: str, to_revision: int = 0) -> dict:
        return json.loads(self._call("ChangeRollout", pb.ChangeRolloutRequest(model=model, action=action,
                                                                             to_revision=to_revision)).json)

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


def usage_row(r: billing_pb.UsageRow) -> dict:
    return {
        "group": r.group, "requests": r.requests, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
        "completion_tokens": r.completion_tokens, "cost_usd": pricing.usd(r.cost_micros), "sessions": r.sessions,
    }


def _budget(b: billing_pb.Budget) -> dict:
    return {"tenant": b.tenant, "amount_usd": b.amount_usd, "month": b.month, "spent_usd": b.spent_usd}


class BillingAdmin(_Service):
    WHAT = "billing"

    def __init__(self, billing_address: str, run_dir: Path | None = None) -> None:
        super().__init__(billing_address, billing_pb2_grpc.BillingStub, run_dir)

    def usage(self, tenant: str, start_ms: int = 0, end_ms: int = 0, group_by: str = "") -> dict:
        r = self._call("GetUsage", billing_pb.GetUsageRequest(
            tenant=tenant, start_unix_ms=start_ms, end_unix_ms=end_ms, group_by=group_by))
        return {"tenant": r.tenant, "total": usage_row(r.total), "rows": [usage_row(x) for x in r.rows]}

    def set_budget(self, tenant: str, amount_usd: float) -> dict:
        return _budget(self._call("SetBudget", billing_pb.SetBudgetRequest(tenant=tenant, amount_usd=amount_usd)))

    def get_budget(self, tenant: str) -> dict:
        return _budget(self._call("GetBudget", billing_pb.GetBudgetRequest(tenant=tenant)))

    def invoice_preview(self, tenant: str, month: str = "") -> dict:
        r = self._call("GetInvoicePreview", billing_pb.GetInvoicePreviewRequest(tenant=tenant, month=month))
        return {
            "tenant": r.tenant, "month": r.month, "requests": r.requests, "total_usd": r.total_usd,
            "lines": [{"model": x.model, "kind": x.kind, "tokens": x.tokens, "amount_usd": x.amount_usd} for x in r.lines],
            "budget": _budget(r.budget), "stripe_customer": r.stripe_customer,
            "meter_events_sent": r.meter_events_sent, "meter_events_pending": r.meter_events_pending,
        }

    def batches(self, tenant: str = "", limit: int = 20, after: str = "") -> tuple[list[dict], bool]:
        """Batches, newest first: a tenant's, or every tenant's (tenant "")."""
        r = self._call("ListBatches", billing_pb.ListBatchesRequest(tenant=tenant, limit=limit, after=after))
        return [batch_dict(b) for b in r.batches], r.has_more

    def batch(self, batch_id: str) -> dict:
        return batch_dict(self._call("GetBatch", billing_pb.BatchRef(batch_id=batch_id)))

    def cancel_batch(self, batch_id: str) -> dict:
        return batch_dict(self._call("CancelBatch", billing_pb.BatchRef(batch_id=batch_id)))

    def status(self) -> dict:
        r = self._call("GetStatus", billing_pb.GetBillingStatusRequest())
        return {
            "stripe_enabled": r.stripe_enabled, "stripe_disabled_reason": r.stripe_disabled_reason,
            "outbox": {"pending": r.outbox_pending, "sent": r.outbox_sent, "failed": r.outbox_failed,
                       "expired": r.outbox_expired, "reconcile": r.outbox_reconcile},
            "last_stripe_error": r.last_stripe_error, "stream_backlog": r.stream_backlog,
            "ledger_rows": r.ledger_rows, "dead_letters": r.dead_letters,
        }


class RouterAdmin(_Service):
    """A router's operator API through its sidecar: any tenant's sessions."""

    WHAT = "the router"

    def __init__(self, address: str) -> None:
        from gaas.v1 import router_pb2_grpc

        super().__init__(address, router_pb2_grpc.RouterStub)

    def list_sessions(self, tenant: str, limit: int = 100):
        from gaas.v1 import router_pb2

        return list(self._call("ListTenantSessions", router_pb2.TenantSessionsRequest(tenant=tenant, limit=limit)).sessions)

    def get_session(self, tenant: str, session_id: str):
        from gaas.v1 import router_pb2

        return self._call("GetTenantSession", router_pb2.TenantSessionRequest(tenant=tenant, session_id=session_id))

    def delete_session(self, tenant: str, session_id: str) -> None:
        from gaas.v1 import router_pb2

        self._call("DeleteTenantSession", router_pb2.TenantSessionRequest(tenant=tenant, session_id=session_id))


def router_flow(address: str, timeout: float = 2.0) -> dict | None:
    """A router's flow control (its queue by band, each worker's window and breaker), through its
    sidecar; None when it does not answer."""
    from gaas.v1 import router_pb2, router_pb2_grpc

    with pki.operator_channel(address) as channel:
        try:
            r = router_pb2_grpc.RouterStub(channel).GetFlowStatus(router_pb2.GetFlowStatusRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
    return {
        "router": r.router, "qos_enabled": r.qos_enabled,
        "bands": [{"band": b.band, "waiting": b.waiting, "queued": b.queued, "admitted": b.admitted, "shed": b.shed,
                   "timed_out": b.timed_out, "wait_p95_ms": round(b.wait_p95_ms, 1)} for b in r.bands],
        "workers": [{"worker_id": w.worker_id, "window": round(w.window, 1), "in_flight": w.in_flight,
                     "window_shrinks": w.window_shrinks, "window_grows": w.window_grows, "breaker": w.breaker,
                     "breaker_trips": w.breaker_trips, "ttft_threshold_ms": round(w.ttft_threshold_ms)}
                    for w in r.workers],
        "tenants": [{"tenant": t.tenant, "tier": t.tier, "in_flight": t.in_flight, "requests_1m": t.requests_1m,
                     "tokens_1m": t.tokens_1m} for t in r.tenants],
    }


def batch_dict(b) -> dict:
    """A batch as OpenAI shows it, and who it is for and at what price."""
    from gaas.openai.batches import batch_object

    return {**batch_object(b), "tenant": b.tenant, "tier": b.tier, "price_factor": b.price_factor}

"""gaas.v1.Control: protobuf <-> registry and catalogue, nothing more (the deployment's methods:
deployrpc.py)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from google.protobuf import json_format

from gaas.contracts import errors, qos
from gaas.runtime.context import current_caller
from gaas.contracts.jsonbody import is_digits
from gaas.contracts.tenancy import DEFAULT_TIER, TIER_FROM_PB, TIER_TO_PB
from gaas.v1 import common_pb2
from gaas.v1 import control_pb2 as pb
from gaas.v1 import control_pb2_grpc
from gaas.contracts.ids import WorkerId
from services.control.catalog import ModelCatalog
from services.control.deployment import Deployment
from services.control.adapters import AdapterStore
from services.control.deployrpc import DeploymentRpcs, adapter_to_pb
from services.control.rollout.driver import Driver
from services.control.prefixes import PrefixStore, PublicPrefix
from gaas.contracts.adapters import Adapter
from gaas.contracts.pricing import Price
from services.control.registry import DRAINING, SERVING, WorkerRecord, WorkerRegistry
from services.control.tenants import LIMIT_NAMES, ApiKey, Tenant, TenantStore

log = logging.getLogger(__name__)

_STATE_TO_PB = {SERVING: pb.WORKER_STATE_SERVING, DRAINING: pb.WORKER_STATE_DRAINING}
_STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}


def worker_to_pb(r: WorkerRecord) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        worker_id=r.worker_id,
        address=r.address,
        model=r.model,
        model_version=r.model_version,
        backend=r.backend,
        device=r.device,
        block_size=r.block_size,
        max_model_len=r.max_model_len,
        state=_STATE_TO_PB.get(r.state, pb.WORKER_STATE_UNSPECIFIED),
        lease_expires_unix_ms=r.lease_expires_ms,
        registered_unix_ms=r.registered_ms,
        engine_version=r.engine_version,
        load=json_format.ParseDict(r.load, common_pb2.WorkerLoad(), ignore_unknown_fields=True),
    )


def _only_the_worker_itself(worker_id: str, address: str | None = None) -> None:
    """A worker's registration is its own: the caller's certificate (verified by control's sidecar)
    must name that worker (or its pool) and, when registering, that address as its sidecar's
    (gaas.contracts.identity.Caller.may_register)."""
    caller = current_caller()
    if caller is None or not caller.may_register(worker_id):
        raise errors.PermissionDenied(
            f"only worker {errors.quote(worker_id)} itself, through its sidecar, may register, renew or deregister it"
        )
    if address is not None and not caller.may_register(worker_id, address):
        raise errors.PermissionDenied(
            f"worker {errors.quote(worker_id)} registers at its own sidecar, not at {errors.quote(address)}"
        )


def _lease(r: WorkerRecord, ttl: int) -> pb.Lease:
    return pb.Lease(worker_id=r.worker_id, expires_unix_ms=r.lease_expires_ms, ttl_seconds=ttl)


def tenant_to_pb(t: Tenant, policies: Mapping[str, qos.TierPolicy] = qos.DEFAULT_POLICIES) -> pb.Tenant:
    tier_limits = policies.get(t.tier, qos.DEFAULT_POLICIES[t.tier]).limits
    effective = {name: getattr(tier_limits, name) if own is None else own for name, own in zip(LIMIT_NAMES, t.own_limits)}
    return pb.Tenant(
        name=t.name, tier=TIER_TO_PB[t.tier], created_unix_ms=t.created_ms, stripe_customer=t.stripe_customer,
        limits=pb.Limits(**effective), own_limits=[n for n, own in zip(LIMIT_NAMES, t.own_limits) if own is not None],
    )


def key_to_pb(k: ApiKey) -> pb.ApiKey:
    return pb.ApiKey(
        key_id=k.key_id, tenant=k.tenant, prefix=k.prefix, created_unix_ms=k.created_ms, revoked_unix_ms=k.revoked_ms
    )


def _load_dict(load) -> dict:
    return json_format.MessageToDict(load, preserving_proto_field_name=True)


def _valid_address(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and is_digits(port) and 0 < int(port) < 65536


def prefix_to_pb(p: PublicPrefix) -> pb.PublicPrefix:
    return pb.PublicPrefix(prefix_id=p.prefix_id, model=p.model, text=p.text, created_unix_ms=p.created_ms)


class ControlServicer(DeploymentRpcs, control_pb2_grpc.ControlServicer):
    def __init__(
        self, registry: WorkerRegistry, catalog: ModelCatalog, tenants: TenantStore, prefixes: PrefixStore | None = None,
        policies: Mapping[str, qos.TierPolicy] = qos.DEFAULT_POLICIES,
        membership_changed: Callable[[], Awaitable[object]] | None = None,
        deployment: Deployment | None = None, driver: Driver | None = None, adapters: AdapterStore | None = None,
    ) -> None:
        self._adapters = adapters
        self._deployment = deployment
        self._driver = driver
        if deployment is not None:
            deployment.on_change.append(self._deployment_changed)
        self._registry = registry
        # Tells the Envoys' membership (services/control/membership.py) at once of a worker that
        # registered or left here (others it finds by reading the registry again).
        self._membership_changed = membership_changed
        self._catalog = catalog
        self._tenants = tenants
        self._prefixes = prefixes
        # The tiers' quotas and targets (the deployment file's qos section).
        self._policies = policies

    async def RegisterWorker(self, request: pb.RegisterWorkerRequest, context) -> pb.Lease:
        w = request.worker
        if not w.worker_id or not w.model:
            raise errors.InvalidArgument("worker.worker_id and worker.model are required")
        if not _valid_address(w.address):
            raise errors.InvalidArgument(f"worker.address {errors.quote(w.address)} must be host:port (its sidecar)")
        _only_the_worker_itself(w.worker_id, w.address)
        known = {m.name for m in await self._catalog.list()}
        if w.model not in known:
            raise errors.FailedPrecondition(
                f"model {errors.quote(w.model)} is not in the applied deployment (known: {', '.join(sorted(known)) or 'none'})"
            )
        record = await self._registry.register(
            WorkerRecord(
                worker_id=WorkerId(w.worker_id),
                address=w.address,
                model=w.model,
                model_version=w.model_version,
                backend=w.backend,
                device=w.device,
                block_size=w.block_size,
                max_model_len=w.max_model_len,
                state=_STATE_FROM_PB.get(w.state, SERVING),
                engine_version=w.engine_version,
                load=_load_dict(w.load) if w.HasField("load") else {},
            )
        )
        log.info("registered %s (%s at %s, %s)", record.worker_id, record.model, record.address, record.device)
        await self._changed()
        return await self._lease_of(record)

    async def RenewLease(self, request: pb.RenewLeaseRequest, context) -> pb.Lease:
        if not request.worker_id:
            raise errors.InvalidArgument("worker_id is required")
        _only_the_worker_itself(request.worker_id)
        record = await self._registry.renew(
            WorkerId(request.worker_id),
            _STATE_FROM_PB.get(request.state),
            _load_dict(request.load) if request.HasField("load") else None,
        )
        return await self._lease_of(record)

    async def _lease_of(self, record: WorkerRecord) -> pb.Lease:
        """The worker's lease, with the ids of the adapters catalogued for its model."""
        lease = _lease(record, self._registry.ttl_seconds)
        lease.adapter_ids.extend(a.adapter_id for a in await self._adapter_list() if a.base_model == record.model)
        return lease

    async def DeregisterWorker(self, request: pb.DeregisterWorkerRequest, context) -> pb.DeregisterWorkerResponse:
        _only_the_worker_itself(request.worker_id)
        if await self._registry.deregister(WorkerId(request.worker_id)):
            log.info("deregistered %s", request.worker_id)
            await self._changed()
        return pb.DeregisterWorkerResponse()

    async def _changed(self) -> None:
        if self._membership_changed is not None:
            try:
                await self._membership_changed()
            except Exception as exc:  # its own poll catches up
                log.debug("membership refresh failed: %s", exc)

    async def ListWorkers(self, request: pb.ListWorkersRequest, context) -> pb.ListWorkersResponse:
        records = await self._registry.list(request.model)
        return pb.ListWorkersResponse(workers=[worker_to_pb(r) for r in records])

    async def CreateTenant(self, request: pb.CreateTenantRequest, context) -> pb.Tenant:
        tier = TIER_FROM_PB.get(request.tier, DEFAULT_TIER)
        tenant = await self._tenants.create_tenant(request.name, tier)
        log.info("created tenant %s (%s)", tenant.name, tenant.tier)
        return self._tenant_pb(tenant)

    async def UpdateTenant(self, request: pb.UpdateTenantRequest, context) -> pb.Tenant:
        tier = TIER_FROM_PB.get(request.tier) if request.HasField("tier") else None
        if request.HasField("tier") and tier is None:
            raise errors.InvalidArgument("tier must be TIER_BRONZE, TIER_SILVER or TIER_GOLD", param="tier")
        customer = request.stripe_customer if request.HasField("stripe_customer") else None
        limits = {}
        for name in LIMIT_NAMES:
            if request.HasField(name):
                value = getattr(request, name)
                if value < -1:
                    raise errors.InvalidArgument(f"{name} must be >= 0 (0: unlimited), or -1 for the tier's", param=name)
                limits[name] = None if value == -1 else value
        tenant = await self._tenants.update_tenant(request.name, tier, customer, limits)
        out = self._tenant_pb(tenant)
        log.info("updated tenant %s (%s, Stripe customer %s, limits rpm %d tpm %d concurrency %d)", tenant.name,
                 tenant.tier, tenant.stripe_customer or "none", out.limits.rpm, out.limits.tpm, out.limits.concurrency)
        return out

    def _tenant_pb(self, tenant: Tenant) -> pb.Tenant:
        applied = self._deployment.qos if self._deployment is not None else None
        return tenant_to_pb(tenant, applied or self._policies)

    async def ListTenants(self, request: pb.ListTenantsRequest, context) -> pb.ListTenantsResponse:
        return pb.ListTenantsResponse(tenants=[self._tenant_pb(t) for t in await self._tenants.list_tenants()])

    async def CreateApiKey(self, request: pb.CreateApiKeyRequest, context) -> pb.CreateApiKeyResponse:
        key, secret = await self._tenants.create_key(request.tenant)
        log.info("created API key %s for tenant %s", key.key_id, key.tenant)
        return pb.CreateApiKeyResponse(key=key_to_pb(key), api_key=secret)

    async def ListApiKeys(self, request: pb.ListApiKeysRequest, context) -> pb.ListApiKeysResponse:
        return pb.ListApiKeysResponse(keys=[key_to_pb(k) for k in await self._tenants.list_keys(request.tenant)])

    async def RevokeApiKey(self, request: pb.RevokeApiKeyRequest, context) -> pb.ApiKey:
        key = await self._tenants.revoke_key(request.key_id)
        log.info("revoked API key %s of tenant %s", key.key_id, key.tenant)
        return key_to_pb(key)

    async def Authenticate(self, request: pb.AuthenticateRequest, context) -> pb.AuthenticateResponse:
        found = (await self._tenants.authenticate(request.api_key, request.key_id)
                 if request.api_key or request.key_id else None)
        if found is None:
            raise errors.Unauthenticated("unknown or revoked API key")
        tenant, key = found
        return pb.AuthenticateResponse(tenant=self._tenant_pb(tenant), key_id=key.key_id, cache_salt=tenant.cache_salt)

    def _adapter_store(self) -> AdapterStore:
        if self._adapters is None:
            raise errors.Unimplemented("this control plane keeps no LoRA adapters")
        return self._adapters

    async def AddAdapter(self, request: pb.AddAdapterRequest, context) -> pb.Adapter:
        a = request.adapter
        if a.public == bool(a.owner):
            raise errors.InvalidArgument("an adapter is either a tenant's (owner) or public, one of the two",
                                         param="owner")
        prices = (a.HasField("price_input"), a.HasField("price_cached_input"), a.HasField("price_output"))
        if any(prices) and not all(prices):
            raise errors.InvalidArgument("give an adapter's three prices (input, cached input, output) or none "
                                         "(the base model's)", param="price")
        price = Price(a.price_input, a.price_cached_input, a.price_output) if all(prices) else None
        models = {}
        served = {s.model.name: s for s in await self._deployment.served()} if self._deployment is not None else {}
        for m in await self._catalog.list():
            s = served.get(m.name)
            models[m.name] = (m.source, list(s.versions.values()) if s is not None else [])
        tenants = {t.name for t in await self._tenants.list_tenants()}
        added = await self._adapter_store().add(
            Adapter(a.name, a.base_model, a.path, 0, a.owner, price=price), models=models, tenants=tenants)
        self._views = {}
        log.info("adapter %s on %s (rank %d, %s) added from %s", added.name, added.base_model, added.rank,
                 f"tenant {added.owner}'s" if added.owner else "public", added.path)
        return adapter_to_pb(added)

    async def ListAdapters(self, request: pb.ListAdaptersRequest, context) -> pb.ListAdaptersResponse:
        return pb.ListAdaptersResponse(adapters=[adapter_to_pb(a) for a in
                                                 await self._adapter_store().list(request.base_model)])

    async def RemoveAdapter(self, request: pb.RemoveAdapterRequest, context) -> pb.RemoveAdapterResponse:
        removed = await self._adapter_store().remove(request.name)
        self._views = {}
        log.info("adapter %s on %s removed: workers unload it", removed.name, removed.base_model)
        return pb.RemoveAdapterResponse()

    def _prefix_store(self) -> PrefixStore:
        if self._prefixes is None:
            raise errors.Unimplemented("this control plane keeps no public prefixes")
        return self._prefixes

    async def AddPublicPrefix(self, request: pb.AddPublicPrefixRequest, context) -> pb.PublicPrefix:
        known = {m.name for m in await self._catalog.list()}
        p = await self._prefix_store().add(request.model, request.text, known)
        log.info("public prefix %s for %s (%d characters): every tenant shares its cached blocks", p.prefix_id,
                 p.model, len(p.text))
        return prefix_to_pb(p)

    async def ListPublicPrefixes(self, request: pb.ListPublicPrefixesRequest, context) -> pb.ListPublicPrefixesResponse:
        return pb.ListPublicPrefixesResponse(prefixes=[prefix_to_pb(p) for p in await self._prefix_store().list(request.model)])

    async def RemovePublicPrefix(self, request: pb.RemovePublicPrefixRequest, context) -> pb.RemovePublicPrefixResponse:
        await self._prefix_store().remove(request.prefix_id)
        log.info("public prefix %s removed: its blocks are per tenant again", request.prefix_id)
        return pb.RemovePublicPrefixResponse()

"""The router's view of the control plane: adapters that turn control's gRPC answers into the
plain callables the directory and the authenticator take."""

from __future__ import annotations

import asyncio
import logging

import grpc

from gaas.contracts.adapters import Adapter
from gaas.contracts.pricing import Price
from gaas.contracts.qos import Limits

from gaas.runtime import status
from gaas.runtime.context import TenantId
from gaas.contracts.tenancy import DEFAULT_TIER, TIER_FROM_PB
from gaas.v1 import control_pb2, control_pb2_grpc
from gaas.contracts.principal import Principal
from gaas.contracts.ids import WorkerId
from gaas.contracts.rollout import Split
from gaas.contracts.tasks import GENERATE
from services.router.directory import ModelEntry, VersionEntry
from services.router.scheduling.types import Candidate, Load

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = 2.0


def control_fetcher(stub: control_pb2_grpc.ControlStub):
    """fetch() for MeshDirectory: the deployed models and the serving workers."""

    async def fetch() -> tuple[list[ModelEntry], list[Candidate]]:
        try:
            models_resp, workers_resp, prefixes_resp = await asyncio.gather(
                stub.ListModels(control_pb2.ListRegisteredModelsRequest(), timeout=CONTROL_TIMEOUT),
                stub.ListWorkers(control_pb2.ListWorkersRequest(), timeout=CONTROL_TIMEOUT),
                stub.ListPublicPrefixes(control_pb2.ListPublicPrefixesRequest(), timeout=CONTROL_TIMEOUT),
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("control plane unreachable: %s %s", exc.code().name, exc.details())
            raise status.from_peer(exc, "control", passes=(), unanswered=status.ALL_CODES,
                                   message="the control plane is unreachable; retry shortly") from None
        public: dict[str, list[tuple[str, str]]] = {}
        for p in prefixes_resp.prefixes:
            public.setdefault(p.model, []).append((p.prefix_id, p.text))
        models = [
            ModelEntry(
                m.name, m.version, m.max_model_len, m.is_default, m.source, tuple(public.get(m.name, ())),
                {TIER_FROM_PB.get(p.tier, DEFAULT_TIER): Price(p.input, p.cached_input, p.output) for p in m.prices},
                versions={v.version: VersionEntry(v.source, v.max_model_len, v.role) for v in m.versions},
                split=_split(m), autoscaled=m.autoscaled, adapters={a.name: _adapter(a) for a in m.adapters},
                wants_workers=m.replicas not in ("", "0"), task=m.task or GENERATE,
            )
            for m in models_resp.models
        ]
        workers = [
            Candidate(
                WorkerId(w.worker_id), w.address, w.model, w.model_version, w.max_model_len, w.engine_version,
                w.block_size, _load(w.load),
            )
            for w in workers_resp.workers
            if w.state == control_pb2.WORKER_STATE_SERVING
        ]
        return models, workers

    return fetch


def _split(m) -> Split | None:
    """A model's split between its versions (None: one version takes everything)."""
    if not m.HasField("split") or not m.split.stable:
        return None
    s = m.split
    try:
        return Split(m.name, stable=s.stable, canary=s.canary, weight=s.weight, shadow=s.shadow, pins=dict(s.pins),
                     kept=tuple(s.kept),
                     tenants={v.version: frozenset(v.tenants) for v in m.versions if v.tenants})
    except ValueError as exc:
        log.warning("control sent a split for %s that cannot be applied (%s); its stable version takes everything",
                    m.name, exc)
        return None


def _load(load) -> Load:
    return Load(
        running=load.running_requests, waiting=load.waiting_requests, kv_usage=load.kv_cache_usage,
        kv_blocks=load.kv_cache_blocks, memory_used=load.device_memory_used, memory_total=load.device_memory_total,
        utilization=load.device_utilization, reported_ms=load.reported_unix_ms,
        adapters=frozenset(load.adapters), adapter_slots=load.adapter_slots,
    )


def _adapter(a: control_pb2.Adapter) -> Adapter:
    price = Price(a.price_input, a.price_cached_input, a.price_output) if a.HasField("price_input") else None
    return Adapter(a.name, a.base_model, a.path, a.rank, "" if a.public else a.owner, a.adapter_id, price,
                   a.created_unix_ms)


def key_lookup(stub: control_pb2_grpc.ControlStub, by: str = "api_key"):
    """lookup(key) for Authenticator: the key's Principal, None when control does not know it (or
    it was revoked). by: what the key is, the secret ("api_key") or its public id ("key_id": a
    batch's, whose secret the router never holds). Other control failures are errors.Unavailable."""

    async def lookup(key: str) -> Principal | None:
        try:
            resp = await stub.Authenticate(control_pb2.AuthenticateRequest(**{by: key}), timeout=CONTROL_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return None
            log.warning("cannot check an API key, control unreachable: %s %s", exc.code().name, exc.details())
            raise status.from_peer(exc, "control", passes=(), unanswered=status.ALL_CODES,
                                   message="cannot check the API key right now; retry shortly") from None
        return Principal(
            tenant=TenantId(resp.tenant.name),
            tier=TIER_FROM_PB.get(resp.tenant.tier, DEFAULT_TIER),
            key_id=resp.key_id,
            cache_salt=resp.cache_salt,
            limits=Limits(rpm=resp.tenant.limits.rpm, tpm=resp.tenant.limits.tpm,
                          concurrency=resp.tenant.limits.concurrency),
        )

    return lookup

"""Tenants and their API keys, in SQL. A key is a random secret shown once; only its SHA-256 is
stored (the secret has 256 bits of entropy, so a fast hash is the right tool, as for session
tokens). Lookups go by hash, so no secret is ever compared in a loop."""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass

from gaas.contracts import errors
from gaas.runtime.sql import Database
from gaas.contracts.tenancy import TENANT_NAME_RE, TIERS

NAME_RE = TENANT_NAME_RE
KEY_PREFIX = "gaas_"
STRIPE_CUSTOMER_RE = re.compile(r"cus_[A-Za-z0-9]{1,64}")

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS tenants (
        name TEXT PRIMARY KEY,
        tier TEXT NOT NULL,
        cache_salt TEXT NOT NULL,
        created_ms BIGINT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS api_keys (
        key_id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL REFERENCES tenants(name),
        key_hash TEXT NOT NULL UNIQUE,
        prefix TEXT NOT NULL,
        created_ms BIGINT NOT NULL,
        revoked_ms BIGINT NOT NULL DEFAULT 0
    )""",
    """CREATE TABLE IF NOT EXISTS tenant_billing (
        tenant TEXT PRIMARY KEY REFERENCES tenants(name),
        stripe_customer TEXT NOT NULL
    )""",
    # A tenant's own quotas; NULL: its tier's.
    """CREATE TABLE IF NOT EXISTS tenant_limits (
        tenant TEXT PRIMARY KEY REFERENCES tenants(name),
        rpm BIGINT,
        tpm BIGINT,
        concurrency BIGINT
    )""",
]
LIMIT_NAMES = ("rpm", "tpm", "concurrency")
# Its tables, those referring to others first (the order to drop them in).
TABLES = ("api_keys", "tenant_billing", "tenant_limits", "tenants")


class TenantError(errors.InvalidArgument):
    """A tenant or key request that cannot be done as asked; str() says why."""


class NotFound(errors.NotFound):
    pass


class AlreadyExists(errors.AlreadyExists):
    pass


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    # bronze, silver or gold.
    tier: str
    # Secret salt of the tenant's prefix-cache keys.
    cache_salt: str
    created_ms: int
    # The Stripe customer its usage is billed to ("" for none).
    stripe_customer: str = ""
    # Its own quotas (rpm, tpm, concurrency; None: its tier's; 0: unlimited).
    own_limits: tuple[int | None, int | None, int | None] = (None, None, None)


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str
    tenant: str
    # First characters of the secret, for recognising it.
    prefix: str
    created_ms: int
    revoked_ms: int


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def _now_ms() -> int:
    return int(time.time() * 1000)


class TenantStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def init_schema(self) -> None:
        for statement in SCHEMA:
            await self._db.execute(statement)

    async def create_tenant(self, name: str, tier: str) -> Tenant:
        if not NAME_RE.fullmatch(name):
            raise TenantError(f"tenant name {name!r} must be 1-63 lower-case letters, digits, '-' or '_'")
        if tier not in TIERS:
            raise TenantError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
        if await self.get_tenant(name) is not None:
            raise AlreadyExists(f"tenant {name!r} already exists")
        tenant = Tenant(name, tier, secrets.token_hex(16), _now_ms())
        await self._db.execute(
            "INSERT INTO tenants (name, tier, cache_salt, created_ms) VALUES (?, ?, ?, ?)",
            (tenant.name, tenant.tier, tenant.cache_salt, tenant.created_ms),
        )
        return tenant

    _SELECT = (
        "SELECT t.name, t.tier, t.cache_salt, t.created_ms, COALESCE(b.stripe_customer, ''), l.rpm, l.tpm,"
        " l.concurrency FROM tenants t LEFT JOIN tenant_billing b ON b.tenant = t.name"
        " LEFT JOIN tenant_limits l ON l.tenant = t.name"
    )

    @staticmethod
    def _tenant(row) -> Tenant:
        name, tier, salt, created, customer, rpm, tpm, concurrency = row
        own = tuple(None if v is None else int(v) for v in (rpm, tpm, concurrency))
        return Tenant(name, tier, salt, int(created), customer, own)

    async def get_tenant(self, name: str) -> Tenant | None:
        rows = await self._db.execute(self._SELECT + " WHERE t.name = ?", (name,))
        return self._tenant(rows[0]) if rows else None

    async def list_tenants(self) -> list[Tenant]:
        return [self._tenant(r) for r in await self._db.execute(self._SELECT + " ORDER BY t.name")]

    async def update_tenant(
        self, name: str, tier: str | None = None, stripe_customer: str | None = None,
        limits: dict[str, int | None] | None = None,
    ) -> Tenant:
        """Change a tenant's tier, Stripe customer ("" removes it) and/or quotas (limits: name ->
        value, 0 unlimited, None back to the tier's); what is not given stays as it is."""
        current = await self.get_tenant(name)
        if current is None:
            raise NotFound(f"tenant {name!r} does not exist; create it with `gaas tenant create {name}`")
        if limits:
            unknown = set(limits) - set(LIMIT_NAMES)
            if unknown:
                raise TenantError(f"unknown quota(s) {', '.join(sorted(unknown))}; quotas: {', '.join(LIMIT_NAMES)}")
            for key, value in limits.items():
                if value is not None and not 0 <= value <= 10**12:
                    raise TenantError(f"{key} must be between 0 (unlimited) and 10^12, got {value}")
            own = dict(zip(LIMIT_NAMES, current.own_limits)) | limits
            await self._db.transaction([
                ("DELETE FROM tenant_limits WHERE tenant = ?", (name,)),
                ("INSERT INTO tenant_limits (tenant, rpm, tpm, concurrency) VALUES (?, ?, ?, ?)",
                 (name, own["rpm"], own["tpm"], own["concurrency"])),
            ])
        if tier is not None:
            if tier not in TIERS:
                raise TenantError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
            await self._db.execute("UPDATE tenants SET tier = ? WHERE name = ?", (tier, name))
        if stripe_customer is not None:
            if stripe_customer and not STRIPE_CUSTOMER_RE.fullmatch(stripe_customer):
                raise TenantError(f"a Stripe customer id looks like 'cus_...', got {stripe_customer!r}")
            await self._db.transaction([
                ("DELETE FROM tenant_billing WHERE tenant = ?", (name,)),
                *([("INSERT INTO tenant_billing (tenant, stripe_customer) VALUES (?, ?)", (name, stripe_customer))]
                  if stripe_customer else []),
            ])
        return await self.get_tenant(name)

    async def create_key(self, tenant: str) -> tuple[ApiKey, str]:
        """A new key for tenant: (its record, the secret). The secret is not kept."""
        if await self.get_tenant(tenant) is None:
            raise NotFound(f"tenant {tenant!r} does not exist; create it first (gaas tenant create)")
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        key = ApiKey("key_" + secrets.token_hex(6), tenant, secret[:9], _now_ms(), 0)
        await self._db.execute(
            "INSERT INTO api_keys (key_id, tenant, key_hash, prefix, created_ms, revoked_ms) VALUES (?, ?, ?, ?, ?, 0)",
            (key.key_id, key.tenant, hash_key(secret), key.prefix, key.created_ms),
        )
        return key, secret

    async def list_keys(self, tenant: str = "") -> list[ApiKey]:
        query = "SELECT key_id, tenant, prefix, created_ms, revoked_ms FROM api_keys"
        params: tuple = ()
        if tenant:
            query += " WHERE tenant = ?"
            params = (tenant,)
        rows = await self._db.execute(query + " ORDER BY created_ms, key_id", params)
        return [ApiKey(k, t, p, int(c), int(r)) for k, t, p, c, r in rows]

    async def revoke_key(self, key_id: str) -> ApiKey:
        rows = await self._db.execute(
            "SELECT key_id, tenant, prefix, created_ms, revoked_ms FROM api_keys WHERE key_id = ?", (key_id,)
        )
        if not rows:
            raise NotFound(f"no API key with id {key_id!r} (gaas key list shows them)")
        key = ApiKey(rows[0][0], rows[0][1], rows[0][2], int(rows[0][3]), int(rows[0][4]))
        if key.revoked_ms:
            return key
        now = _now_ms()
        await self._db.execute("UPDATE api_keys SET revoked_ms = ? WHERE key_id = ?", (now, key_id))
        return ApiKey(key.key_id, key.tenant, key.prefix, key.created_ms, now)

    async def authenticate(self, secret: str = "", key_id: str = "") -> tuple[Tenant, ApiKey] | None:
        """The tenant and key of a live secret (or of a key's public id); None for an unknown or
        revoked one, or one whose tenant is gone."""
        column, value = ("k.key_hash", hash_key(secret)) if secret else ("k.key_id", key_id)
        rows = await self._db.execute(
            "SELECT k.key_id, k.prefix, k.created_ms, t.name, t.tier, t.cache_salt, t.created_ms"
            f" FROM api_keys k JOIN tenants t ON t.name = k.tenant WHERE {column} = ? AND k.revoked_ms = 0",
            (value,),
        )
        if not rows:
            return None
        key_id, prefix, key_created, name, tier, salt, tenant_created = rows[0]
        tenant = await self.get_tenant(name) or Tenant(name, tier, salt, int(tenant_created))
        return tenant, ApiKey(key_id, name, prefix, int(key_created), 0)

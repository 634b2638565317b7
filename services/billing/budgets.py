"""Monthly budgets: kept in the ledger's database, mirrored into Redis where the routers enforce
them (gaas.contracts.usage's keys and scripts). The mirror is rewritten at start and every few seconds,
and a tenant's spend counter for the month, should Redis have lost it, is rebuilt from the ledger."""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gaas.contracts import usage
from gaas.metering import admission
from services.billing.ledger import Ledger

log = logging.getLogger(__name__)


class Budgets:
    def __init__(self, ledger: Ledger, redis: Redis) -> None:
        self._ledger = ledger
        self._redis = redis

    async def set(self, tenant: str, micros: int) -> None:
        """Set (0: remove) a tenant's budget, durably, then for the routers."""
        await self._ledger.set_budget(tenant, micros)
        await self._mirror_one(tenant, micros)

    async def get(self, tenant: str) -> int:
        return (await self._ledger.budgets()).get(tenant, 0)

    async def spent(self, tenant: str, month: str) -> int:
        start, end = usage.month_bounds(month)
        return (await self._ledger.totals(tenant, start, end)).cost_micros

    async def _mirror_one(self, tenant: str, micros: int) -> None:
        if micros:
            await self._redis.set(admission.budget_key(tenant), micros)
            month = usage.month_of(usage.now_ms())
            spent = await self.spent(tenant, month)
            # NX: a live counter already holds requests the ledger has not caught up with.
            await self._redis.set(admission.spend_key(tenant, month), spent, nx=True, ex=admission.SPEND_TTL_SECONDS)
        else:
            await self._redis.delete(admission.budget_key(tenant))

    async def mirror(self) -> None:
        """Every budget into Redis (and every lost spend counter rebuilt)."""
        for tenant, micros in (await self._ledger.budgets()).items():
            await self._mirror_one(tenant, micros)

    async def run(self, every_seconds: float = 5.0) -> None:
        failing = False
        while True:
            try:
                await self.mirror()
                failing = False
            except RedisError as exc:
                if not failing:
                    log.warning("cannot write the budgets to Redis (%s); retrying", exc)
                failing = True
            await asyncio.sleep(every_seconds)

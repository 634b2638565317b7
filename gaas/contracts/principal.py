"""Who a request is for, as the router authenticated it: what the router decides with, and what a
worker meters a request the router sent it straight from the ingress under."""

from __future__ import annotations

from dataclasses import dataclass

from gaas.contracts.qos import BATCH, Limits
from gaas.contracts.ids import TenantId


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: TenantId
    # bronze, silver or gold.
    tier: str
    # Public id of the key used.
    key_id: str
    # The tenant's prefix-cache salt, set on every engine request.
    cache_salt: str
    # Its quotas (its own, else its tier's, as control resolved them).
    limits: Limits = Limits()
    # A batch's item, run by a router for the tenant (gaas.contracts.batches): served in the batch
    # band, below every tier's, at the tier's prices times the batch's price factor.
    batch: bool = False

    @property
    def band_name(self) -> str:
        """What the router orders and sheds it by (gaas.contracts.qos): its tier, or the batch band."""
        return BATCH if self.batch else self.tier


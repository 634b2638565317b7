"""Which version of a model a new request goes to, from the split control publishes
(gaas/contracts/rollout.py): a pinned tenant's version, else a session's (while it is the stable
or the new version), else the canary for the split's weight of requests and the stable version for
the rest. Only versions the tenant may use (a pool's tenants) and that have workers now are chosen;
one that has none leaves the request to another rather than to nobody.

The weighted choice is a smooth one, not a coin: each request adds the weight to the model's credit
and takes the canary when the credit reaches 100 (which pays 100 back), so after n requests the
canary has taken n * weight / 100 of them to within one request, on every router, and a 5% step is
5% from its first requests on, not a noisy share that 1,000 requests only bring near it."""

from __future__ import annotations

from collections.abc import Container

from gaas.contracts import errors
from gaas.contracts.rollout import PERCENT, Split


class VersionChooser:
    def __init__(self) -> None:
        self._credit: dict[str, int] = {}
        self._shadow_credit: dict[str, int] = {}

    def choose(self, split: Split, tenant: str = "", session_version: str = "",
               available: Container[str] | None = None) -> str:
        """The version for a new request of tenant's (a session's turn: session_version, the
        version its first turn took). available: the versions with workers (None: every one).
        errors.PermissionDenied when the tenant may use none of them."""

        def usable(version: str) -> bool:
            return bool(version) and (available is None or version in available) and split.may_use(tenant, version)

        pinned = split.pins.get(tenant, "")
        if pinned in split.versions and usable(pinned):
            return pinned
        if session_version in (split.stable, split.canary) and usable(session_version):
            return session_version
        canary, stable = usable(split.canary) and split.weight > 0, usable(split.stable) and split.weight < PERCENT
        if canary and stable:
            return split.canary if _take(self._credit, split.model, split.weight) else split.stable
        if canary or stable:
            return split.canary if canary else split.stable
        # The split's choice cannot take it (no workers, or not this tenant's): any version that can.
        for version in (split.stable, split.canary):
            if usable(version):
                return version
        if not any(split.may_use(tenant, v) for v in split.versions):
            raise errors.PermissionDenied(f"model {errors.quote(split.model)} is not available to this tenant",
                                          param="model")
        return split.stable

    def shadow(self, split: Split) -> bool:
        """Whether this request is also copied to the canary (shadow traffic)."""
        if not split.canary or split.shadow <= 0:
            return False
        return _take(self._shadow_credit, split.model, split.shadow)


def _take(credits: dict[str, int], model: str, pct: int) -> bool:
    credit = credits.get(model, 0) + pct
    taken = credit >= PERCENT
    credits[model] = credit - PERCENT if taken else credit
    return taken

"""Which version of a model a new request goes to, from the split control publishes
(gaas/contracts/rollout.py): a pinned tenant's version, else a session's (while it is the stable
or the new version), else the canary for the split's weight of requests and the stable version for
the rest. Only versions the tenant may use (a pool's tenants) and that have workers now are chosen;
one that has none leaves the request to another rather than to nobody.

The weighted choice is a smooth one, not a coin: each request adds the weight to its tenant's credit
for the model and takes the canary when the credit reaches 100 (which pays 100 back), so after n
requests a tenant's canary share is n * weight / 100 to within one request, on every router, and a 5%
step is 5% from its first requests on, not a noisy share that 1,000 requests only bring near it. The
credit is each tenant's own (one credit for all would let tenants whose requests come in step with
each other's take the canary always or never), and starts anywhere below 100 (else every tenant's
first requests would all go to the stable version)."""

from __future__ import annotations

import random
from collections.abc import Callable, Container

from gaas.contracts import errors
from gaas.contracts.rollout import PERCENT, Split


# Credits kept at most (model, tenant) pairs; past it the oldest are forgotten (a tenant's credit
# then starts afresh).
MAX_CREDITS = 100_000


class VersionChooser:
    def __init__(self, start: Callable[[], int] = lambda: random.randrange(PERCENT)) -> None:
        """start: a new credit's value (random below 100; tests fix it)."""
        self._start = start
        self._credit: dict[tuple[str, str], int] = {}
        self._shadow_credit: dict[tuple[str, str], int] = {}

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
            return split.canary if self._take(self._credit, (split.model, tenant), split.weight) else split.stable
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

    def shadow(self, split: Split, tenant: str = "") -> bool:
        """Whether this request of tenant's is also copied to the canary (shadow traffic)."""
        if not split.canary or split.shadow <= 0:
            return False
        return self._take(self._shadow_credit, (split.model, tenant), split.shadow)

    def _take(self, credits: dict[tuple[str, str], int], key: tuple[str, str], pct: int) -> bool:
        credit = credits.pop(key, None)
        if credit is None:
            credit = self._start()
            if len(credits) >= MAX_CREDITS:
                del credits[next(iter(credits))]
        credit += pct
        taken = credit >= PERCENT
        credits[key] = credit - PERCENT if taken else credit  # (re-inserted: the most recent last)
        return taken

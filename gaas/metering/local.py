"""One router's own count of what it admitted, per tenant (LocalQuotas), and admission by that count
while Redis does not answer (the fallback).

Every router draws from the tenant's quotas in Redis, so its own count is a lower bound of the
whole: a request its tenant is over by this count alone (or that Redis refused on the requests-per-
minute quota, until the refusal's retry time) is refused before its body is parsed, sessions are
read or its prompt is tokenized (Meter.precheck).

While Redis does not answer, this count admits by what the tenant may do: its own quotas (its
tier's, or its own limits), each shared among the live routers (divided by their number as Redis
last told, gaas.metering.peers, rounded up; assumed alone while it never told). A quota of 0 is
unlimited here too: a tenant without limits is not limited by the fallback. What a tenant's
requests used (not the most they could) counts against its tokens once they end. Its monthly
budget: the room Redis last reported to this router (at its last admission of that tenant's
requests), shared among the routers the same way, less the most each request admitted since
without Redis could cost; a tenant this router has not admitted through Redis since it started
is admitted without a budget check (what it uses is metered, spooled and billed once Redis is
back, and counts against its budget from then on).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gaas.contracts import errors
from gaas.contracts.principal import Principal
from gaas.contracts.qos import Limits
from gaas.metering import admission

if TYPE_CHECKING:
    from gaas.metering.meter import Metered


@dataclass(slots=True)
class _Admission:
    """One request this process admitted."""

    # When (the count's monotonic clock, seconds).
    at: float
    # Its tokens: reserved at admission (prompt + the most it may generate), what it used once it
    # ended (when its end says).
    tokens: int


@dataclass(slots=True)
class _Seen:
    """What one process admitted for one tenant."""

    # Request id -> (sequences, its admission), for each request in flight.
    in_flight: dict = field(default_factory=dict)
    # Its admissions within the last minute, oldest first.
    admitted: deque = field(default_factory=deque)
    # Refused by the requests-per-minute quota until then (monotonic), and the refusal.
    refused_until: float = 0.0
    refusal: errors.ResourceExhausted | None = None
    # Its monthly budget's room when Redis last admitted one of its requests (micro-dollars; None:
    # no budget, or not known).
    headroom: int | None = None
    # The most the requests admitted without Redis since could cost (micro-dollars).
    unchecked_cost: int = 0


def share(limit: int, routers: int) -> int:
    """A router's part of a tenant's quota while Redis is away: the quota divided among the live
    routers, rounded up (never 0 for a tenant that has a quota); 0 (unlimited) stays unlimited."""
    return -(-limit // max(1, routers)) if limit > 0 else 0


class LocalQuotas:
    """One process's own count, per tenant: the sequences it has in flight, the requests and tokens
    it admitted in the last minute (see the module's docstring for how it is used)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window: float = 60.0,
                 routers: Callable[[], int] = lambda: 1) -> None:
        self._clock = clock
        self._window = window
        # How many routers share each tenant's quotas (gaas.metering.peers.Peers.routers).
        self._routers = routers
        self._tenants: dict[str, _Seen] = {}

    def _seen(self, tenant: str) -> _Seen:
        s = self._tenants.get(tenant)
        if s is None:
            s = self._tenants[tenant] = _Seen()
        return s

    def _recent(self, s: _Seen) -> deque:
        horizon = self._clock() - self._window
        while s.admitted and s.admitted[0].at <= horizon:
            s.admitted.popleft()
        return s.admitted

    def check(self, principal: Principal, sequences: int = 1) -> None:
        """Refuse (ResourceExhausted) what this count alone says cannot be admitted: sequences more
        at once than the tenant's limit, one request more this minute than its quota, or a
        requests-per-minute refusal of Redis's until its retry time. (Tokens are not checked: this
        count holds a request's most until it ends, Redis what it used.)"""
        s = self._tenants.get(principal.tenant)
        if s is None:
            return
        limits = principal.limits
        err = self._over(principal.tenant, s, sequences, Limits(limits.rpm, 0, limits.concurrency))
        if err is not None:
            raise err

    def _over(self, tenant: str, s: _Seen, sequences: int, limits: Limits,
              note: str = "") -> errors.ResourceExhausted | None:
        """The refusal of one request more of sequences by this count against limits (0: none): a
        request alone, or the first of the minute, always fits (the quotas are shared among routers
        rounded up: a router's share never refuses what the whole quota would admit alone); note:
        added to what this count refuses."""
        now = self._clock()
        if s.refusal is not None and now < s.refused_until:
            return errors.ResourceExhausted(s.refusal.message, reason=s.refusal.reason,
                                            retry_after=max(1.0, s.refused_until - now), quota=s.refusal.quota)

        def refuse(answer: int, a: int, b: int, retry_ms: int) -> errors.ResourceExhausted:
            err = admission.refusal(tenant, answer, a, b, 0, retry_ms, 0, 0, 0)
            return errors.ResourceExhausted(err.message + note, reason=err.reason, retry_after=err.retry_after,
                                            quota=err.quota) if note else err

        running = sum(n for n, _ in s.in_flight.values())
        if limits.concurrency and running and running + sequences > limits.concurrency:
            return refuse(admission.OVER_CONCURRENCY, running, limits.concurrency, 1000)
        recent = self._recent(s)
        if limits.rpm and len(recent) >= limits.rpm:
            return refuse(admission.OVER_RPM, len(recent), limits.rpm,
                          int((recent[-limits.rpm].at + self._window - now) * 1000))
        if limits.tpm and (used := sum(a.tokens for a in recent)) >= limits.tpm:
            return refuse(admission.OVER_TPM, used, limits.tpm, int((recent[0].at + self._window - now) * 1000))
        return None

    def _count(self, s: _Seen, m: Metered, tokens: int) -> None:
        a = _Admission(self._clock(), tokens)
        s.in_flight[m.request_id] = (m.sequences, a)
        s.admitted.append(a)

    def admitted(self, m: Metered, tokens: int, headroom: int | None) -> None:
        """Redis admitted m (reserving tokens); headroom: its tenant's budget's room left after it."""
        s = self._seen(m.principal.tenant)
        self._count(s, m, tokens)
        s.headroom, s.unchecked_cost = headroom, 0
        s.refusal = None

    def refused(self, tenant: str, answer: int, err: errors.ResourceExhausted) -> None:
        """Redis refused a request: on the requests-per-minute quota the refusal holds until its
        retry time (only more requests can come before then); the others depend on the request."""
        if answer == admission.OVER_RPM and err.retry_after:
            s = self._seen(tenant)
            s.refusal, s.refused_until = err, self._clock() + err.retry_after

    def ended(self, m: Metered, used_tokens: int | None = None) -> None:
        """m is over; used_tokens: what it used (None: not known, its reservation stands)."""
        s = self._tenants.get(m.principal.tenant)
        if s is None:
            return
        entry = s.in_flight.pop(m.request_id, None)
        if entry is not None and used_tokens is not None:
            entry[1].tokens = used_tokens
        if not s.in_flight and not self._recent(s) and s.headroom is None and s.refusal is None:
            del self._tenants[m.principal.tenant]

    def admit_degraded(self, m: Metered, tokens: int, estimate: int) -> None:
        """Admit m without Redis (the fallback): its tenant's quotas and budget's room shared among
        the routers, by this count; ResourceExhausted when over."""
        tenant, limits = m.principal.tenant, m.principal.limits
        if limits.concurrency and m.sequences > limits.concurrency:  # as Redis would answer
            raise admission.refusal(tenant, admission.TOO_MANY_SEQUENCES, m.sequences, limits.concurrency, 0, 0, 0,
                                    0, 0)
        if limits.tpm and tokens > limits.tpm:
            raise admission.refusal(tenant, admission.TOO_LARGE_FOR_TPM, tokens, limits.tpm, 0, 0, 0, tokens, 0)
        routers = max(1, self._routers())
        mine = Limits(share(limits.rpm, routers), share(limits.tpm, routers), share(limits.concurrency, routers))
        s = self._seen(tenant)
        note = (f" (while quotas cannot be counted in Redis, each of the {routers} routers admits its share of "
                "the tenant's quotas)") if routers > 1 else ""
        err = self._over(tenant, s, m.sequences, mine, note)
        if err is not None:
            raise err
        if s.headroom is not None:
            if s.unchecked_cost + estimate > s.headroom // routers:
                raise errors.ResourceExhausted(
                    f"tenant {tenant}'s monthly budget has no room left for this request as last counted, and it "
                    "cannot be counted again right now: retry shortly", reason="insufficient_quota",
                    retry_after=5.0, quota=errors.QuotaViolation(f"tenant:{tenant}", "monthly budget"))
            s.unchecked_cost += estimate
        self._count(s, m, tokens)

"""Usage to Stripe: the ledger's rows, once their time window has closed, are summed per tenant,
meter (input, cached-input and output tokens) and window into an outbox of meter events, in the
same transaction that marks the rows reported; a sender sends the outbox with the official SDK,
each event with an identifier derived from (tenant, meter, window, batch), so a retry is never
counted twice; failures back off (Stripe down for an hour loses nothing and catches up after).

Stripe's own limits, respected: meter events at most `rate_per_s` per second (Stripe allows
~1,000/s in live mode); an identifier is deduplicated over at least 24 hours, so an event still
unconfirmed a day after its first attempt is not resent blindly but reconciled against the meter's
event summaries (Stripe has it: confirmed; Stripe's sum lacks exactly it: sent again under a new
identifier; anything else: left for a person, with both figures); a timestamp must be within the
past 35 days, so older windows are marked expired (and shown) instead of failing forever.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from gaas.runtime.sql import Database

log = logging.getLogger(__name__)

KINDS = ("input", "cached_input", "output")
DEDUPE_SECONDS = 23 * 3600
MAX_AGE_SECONDS = 35 * 86400 - 3600
MAX_BACKOFF_SECONDS = 300.0


class Retryable(Exception):
    """Stripe could not take the event now (rate limited, down, unreachable)."""


class Duplicate(Exception):
    """Stripe already has an event with this identifier: it was recorded."""


class Rejected(Exception):
    """Stripe refuses the event as sent (a configuration problem: unknown meter or customer)."""


class MeterSender(ABC):
    @abstractmethod
    def send(self, event_name: str, customer: str, value: int, timestamp_s: int, identifier: str) -> None: ...

    @abstractmethod
    def summary(self, event_name: str, customer: str, start_s: int, end_s: int) -> int:
        """The meter's aggregated value for the customer over [start_s, end_s) (minute-aligned)."""


class StripeMeterSender(MeterSender):
    """The official SDK, pointed at api_base (Stripe, or a test server that speaks its contract)."""

    def __init__(self, api_key: str, api_base: str) -> None:
        import stripe

        self._stripe = stripe
        self._client = stripe.StripeClient(api_key, base_addresses={"api": api_base}, max_network_retries=0)
        self._meter_ids: dict[str, str] = {}

    def send(self, event_name: str, customer: str, value: int, timestamp_s: int, identifier: str) -> None:
        stripe = self._stripe
        try:
            self._client.v1.billing.meter_events.create({
                "event_name": event_name,
                "payload": {"stripe_customer_id": customer, "value": str(value)},
                "identifier": identifier,
                "timestamp": timestamp_s,
            })
        except stripe.InvalidRequestError as exc:
            if getattr(exc, "code", "") == "resource_already_exists" or "already exists" in str(exc):
                raise Duplicate(str(exc)) from None
            raise Rejected(f"{exc.code or 'invalid_request'}: {exc.user_message or exc}") from None
        except self._retryable as exc:
            raise Retryable(f"{type(exc).__name__}: {getattr(exc, 'user_message', None) or exc}") from None

    @property
    def _retryable(self) -> tuple[type[Exception], ...]:
        s = self._stripe
        return (s.RateLimitError, s.APIConnectionError, s.APIError, s.AuthenticationError, s.PermissionError)

    def _meter_id(self, event_name: str) -> str:
        if event_name not in self._meter_ids:
            for meter in self._client.v1.billing.meters.list({"limit": 100}).auto_paging_iter():
                self._meter_ids[meter.event_name] = meter.id
        if event_name not in self._meter_ids:
            raise Rejected(f"no Stripe meter has the event name {event_name!r}: create it, or fix billing.meters")
        return self._meter_ids[event_name]

    def summary(self, event_name: str, customer: str, start_s: int, end_s: int) -> int:
        try:
            summaries = self._client.v1.billing.meters.event_summaries.list(
                self._meter_id(event_name), {"customer": customer, "start_time": start_s, "end_time": end_s},
            )
            return int(sum(float(x.aggregated_value) for x in summaries.auto_paging_iter()))
        except self._stripe.InvalidRequestError as exc:
            raise Rejected(f"{exc.code or 'invalid_request'}: {exc.user_message or exc}") from None
        except self._retryable as exc:
            raise Retryable(f"{type(exc).__name__}: {getattr(exc, 'user_message', None) or exc}") from None


def identifier(tenant: str, event_name: str, window_start_ms: int, batch: int) -> str:
    """Deterministic (so a retry is the same event), at most 100 characters as Stripe requires."""
    digest = hashlib.sha256(f"{tenant}\0{event_name}\0{window_start_ms}\0{batch}".encode()).hexdigest()[:40]
    return f"gaas_{digest}"


def _describe(exc: Exception) -> str:
    """One line on a failed round: a gRPC call (control, for the tenants' customers) or a database."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"cannot read the tenants' Stripe customers from control: {exc.code().name} {exc.details() or ''}".strip()
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def _resend_identifier(ident: str) -> str:
    """A new identifier for an event sent again after reconciling (the old one may be deduplicated)."""
    base, _, n = ident.partition(".r")
    return f"{base}.r{int(n or 0) + 1}"


@dataclass(frozen=True, slots=True)
class OutboxCounts:
    pending: int = 0
    sent: int = 0
    failed: int = 0
    expired: int = 0
    reconcile: int = 0


class StripeSync:
    def __init__(
        self,
        db: Database,
        sender: MeterSender | None,
        meters: dict[str, str],
        customers: Callable[[], Awaitable[dict[str, str]]],
        window_seconds: float = 3600.0,
        grace_seconds: float = 120.0,
        rate_per_s: int = 100,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._db = db
        self.sender = sender
        self._meters = meters
        self._customers = customers
        self._window_ms = int(window_seconds * 1000)
        self._grace_ms = int(grace_seconds * 1000)
        self._rate = rate_per_s
        self._clock = clock
        self.last_error = ""
        # Retryable failures in a row, and no sending before this time (Stripe is unwell).
        self._failures = 0
        self._paused_until_ms = 0
        # Errors noted so far (a round that notes none clears last_error).
        self._errors = 0

    def _note_error(self, message: str) -> None:
        self.last_error = message
        self._errors += 1

    @property
    def enabled(self) -> bool:
        return self.sender is not None

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    async def collect(self) -> int:
        """Turn closed windows' unreported rows into outbox events; returns the events added."""
        customers = {t: c for t, c in (await self._customers()).items() if c}
        if not customers:
            return 0
        closed_before = (self._now_ms() - self._grace_ms) // self._window_ms * self._window_ms
        w = self._window_ms

        def run(execute) -> int:
            added = 0
            pairs = execute(
                f"SELECT DISTINCT tenant, finished_ms / {w} FROM usage_ledger WHERE stripe_batch IS NULL"
                " AND finished_ms < ?", (closed_before,),
            )
            for tenant, window in pairs:
                if tenant not in customers:
                    continue
                start = int(window) * w
                n = execute("SELECT COUNT(DISTINCT batch) FROM stripe_outbox WHERE tenant = ? AND window_start_ms = ?",
                            (tenant, start))[0][0]
                batch = f"{tenant}:{start}:{int(n) + 1}"
                execute("UPDATE usage_ledger SET stripe_batch = ? WHERE stripe_batch IS NULL AND tenant = ?"
                        " AND finished_ms >= ? AND finished_ms < ?", (batch, tenant, start, start + w))
                (uncached, cached, output), = execute(
                    "SELECT COALESCE(SUM(prompt_tokens - cached_tokens), 0), COALESCE(SUM(cached_tokens), 0),"
                    " COALESCE(SUM(completion_tokens), 0) FROM usage_ledger WHERE stripe_batch = ?", (batch,),
                )
                for kind, value in zip(KINDS, (uncached, cached, output)):
                    if int(value) <= 0:
                        continue
                    event_name = self._meters[kind]
                    execute(
                        "INSERT INTO stripe_outbox (identifier, batch, tenant, customer, event_name, window_start_ms,"
                        " value, state) VALUES (?, ?, ?, ?, ?, ?, ?, 'pending')",
                        (identifier(tenant, event_name, start, int(n) + 1), batch, tenant, customers[tenant],
                         event_name, start, int(value)),
                    )
                    added += 1
            return added

        added = await self._db.run(run)
        if added:
            log.info("%d meter events ready for Stripe", added)
        return added

    async def send_due(self) -> int:
        """Send what is due (at most rate_per_s events); returns how many Stripe took."""
        if self.sender is None:
            return 0
        now = self._now_ms()
        if now < self._paused_until_ms:
            return 0
        due = await self._db.execute(
            "SELECT identifier, customer, event_name, window_start_ms, value, attempts, first_attempt_ms"
            " FROM stripe_outbox WHERE state = 'pending' AND next_attempt_ms <= ? ORDER BY next_attempt_ms LIMIT ?",
            (now, self._rate),
        )
        sent = 0
        for ident, customer, event_name, start, value, attempts, first in due:
            first = int(first) or now
            if now - int(start) > MAX_AGE_SECONDS * 1000:
                await self._set(ident, "expired", attempts, first, "older than Stripe accepts (35 days)")
                log.error("meter event %s for %s is older than Stripe accepts: marked expired", ident, customer)
                continue
            if attempts and now - first > DEDUPE_SECONDS * 1000:
                # Stripe may have it already; sending again after its dedupe window could count it twice.
                await self._set(ident, "reconcile", attempts, first, "unconfirmed for 23 h: check the meter's summaries")
                log.error("meter event %s unconfirmed for a day: needs reconciling, not resending", ident)
                continue
            try:
                await asyncio.to_thread(self.sender.send, event_name, customer, int(value), int(start) // 1000, ident)
            except Duplicate:
                pass
            except Retryable as exc:
                # Stripe is unwell: nothing more is sent until a backoff that grows with each failure
                # in a row (1 s ... 5 min) has passed, whichever event is next.
                self._note_error(str(exc))
                self._failures += 1
                delay = min(MAX_BACKOFF_SECONDS, 2.0 ** min(self._failures - 1, 16)) * random.uniform(0.5, 1.0)
                self._paused_until_ms = now + int(delay * 1000)
                await self._set(ident, "pending", int(attempts) + 1, first, str(exc), next_attempt=self._paused_until_ms)
                break
            except Rejected as exc:
                self._note_error(str(exc))
                await self._set(ident, "failed", int(attempts) + 1, first, str(exc))
                log.error("Stripe refused meter event %s: %s", ident, exc)
                continue
            self._failures = 0
            await self._db.execute(
                "UPDATE stripe_outbox SET state = 'sent', attempts = ?, first_attempt_ms = ?, sent_ms = ? WHERE identifier = ?",
                (int(attempts) + 1, first, self._now_ms(), ident),
            )
            sent += 1
        return sent

    async def reconcile(self) -> int:
        """Settle events unconfirmed past Stripe's dedupe window against the meter's summaries, a
        (customer, meter, minute) at a time; returns how many were settled."""
        if self.sender is None:
            return 0
        groups = await self._db.execute(
            "SELECT DISTINCT customer, event_name, window_start_ms / 60000 FROM stripe_outbox WHERE state = 'reconcile'"
        )
        settled = 0
        for customer, event_name, minute in groups:
            start, end = int(minute) * 60000, int(minute) * 60000 + 60000
            rows = await self._db.execute(
                "SELECT identifier, state, value FROM stripe_outbox WHERE customer = ? AND event_name = ?"
                " AND window_start_ms >= ? AND window_start_ms < ?", (customer, event_name, start, end),
            )
            if any(state == "pending" for _, state, _ in rows):
                continue  # settle once nothing of that minute is in flight
            confirmed = sum(int(v) for _, state, v in rows if state == "sent")
            unsettled = [(ident, int(v)) for ident, state, v in rows if state == "reconcile"]
            try:
                stripe_has = await asyncio.to_thread(self.sender.summary, event_name, customer, start // 1000, end // 1000)
            except (Retryable, Rejected) as exc:
                self._note_error(str(exc))
                log.warning("cannot reconcile %s's %s meter events: %s", customer, event_name, exc)
                continue
            missing = sum(v for _, v in unsettled)
            if stripe_has == confirmed + missing:  # Stripe got them all: confirmed
                for ident, _ in unsettled:
                    await self._db.execute("UPDATE stripe_outbox SET state = 'sent', sent_ms = ?, last_error = ''"
                                           " WHERE identifier = ?", (self._now_ms(), ident))
            elif stripe_has == confirmed:  # Stripe got none of them: send again, as new events
                for ident, _ in unsettled:
                    await self._db.execute(
                        "UPDATE stripe_outbox SET identifier = ?, state = 'pending', attempts = 0, first_attempt_ms = 0,"
                        " next_attempt_ms = 0, last_error = 'resent after reconciling' WHERE identifier = ?",
                        (_resend_identifier(ident), ident),
                    )
                log.warning("%d meter events for %s never reached Stripe: sent again", len(unsettled), customer)
            else:
                note = (f"Stripe's {event_name} summary for {customer} is {stripe_has}, the outbox has {confirmed} "
                        f"confirmed and {missing} unconfirmed: settle by hand")
                for ident, _ in unsettled:
                    await self._db.execute("UPDATE stripe_outbox SET last_error = ? WHERE identifier = ?", (note, ident))
                log.error(note)
                continue
            settled += len(unsettled)
        return settled

    async def _set(self, ident: str, state: str, attempts: int, first: int, error: str, next_attempt: int = 0) -> None:
        await self._db.execute(
            "UPDATE stripe_outbox SET state = ?, attempts = ?, first_attempt_ms = ?, last_error = ?, next_attempt_ms = ?"
            " WHERE identifier = ?",
            (state, attempts, first, error[:500], next_attempt, ident),
        )

    async def counts(self, tenant: str = "", start_ms: int = 0, end_ms: int = 0) -> OutboxCounts:
        query, params = "SELECT state, COUNT(*) FROM stripe_outbox WHERE 1 = 1", []
        if tenant:
            query += " AND tenant = ?"
            params.append(tenant)
        if end_ms:
            query += " AND window_start_ms >= ? AND window_start_ms < ?"
            params += [start_ms, end_ms]
        rows = dict(await self._db.execute(query + " GROUP BY state", params))
        return OutboxCounts(**{k: int(rows.get(k, 0)) for k in ("pending", "sent", "failed", "expired", "reconcile")})

    async def run(self, every_seconds: float = 1.0) -> None:
        """Collect and send until cancelled (and reconcile every 10 minutes); failures are logged
        and retried."""
        next_reconcile = 0.0
        while True:
            errors_before = self._errors
            try:
                await self.collect()
                await self.send_due()
                if time.monotonic() >= next_reconcile:
                    next_reconcile = time.monotonic() + 600
                    await self.reconcile()
                if self._errors == errors_before:
                    self.last_error = ""
            except Exception as exc:  # noqa: BLE001 - the outbox stays; the next round retries
                self._note_error(_describe(exc))
                log.warning("Stripe sync round failed: %s", self.last_error)
            await asyncio.sleep(every_seconds)

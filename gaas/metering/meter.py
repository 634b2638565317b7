"""Admission and metering, shared by whoever serves a request (the router, or a worker the ingress
sent it to straight): a tenant's quotas and budget checked (and the
request's place, tokens and most possible cost reserved; gaas.metering.admission) before a request starts,
and one usage event appended to the Redis Stream when it ends, before its last chunk is released:
finished, cancelled by the client, or failed after tokens were produced. A request retried on a
second worker before its first token is one event.

Beside Redis, the process that admits (a router) keeps its own count of what it admitted for each
tenant (LocalQuotas): a request its tenant cannot be admitted for by this process's count alone is
refused before its body is parsed or tokenized (cheap refusals first), and while Redis does not
answer, that count is what admits, bounded (never unlimited for everyone).

Never losing a record: when Redis does not answer, the event goes to a local spool file (an
append-only JSON-lines file, flushed and fsynced) and a background task appends it once Redis is
back; the ledger is written once per request id whatever is replayed twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from gaas.contracts import errors, latency, pricing, usage as metering
from gaas.metering import admission
from gaas.contracts.usage import UsageEvent
from gaas.runtime.redisconn import Script
from gaas.v1 import common_pb2
from gaas.contracts.principal import Principal

log = logging.getLogger(__name__)

# A reservation lapses after this (a router that died mid-request must not hold a budget forever).
RESERVATION_SECONDS = 900


@dataclass(slots=True)
class Metered:
    """One client request being metered: what it was admitted for, and what it has produced."""

    request_id: str
    principal: Principal
    model: str
    model_version: str
    price: pricing.Price
    # Engine requests it consists of (prompts of a batch); each ends with a usage chunk.
    parts: int
    client_request_id: str
    arrived: float
    # Whether Redis admitted it (and holds its place, tokens and cost until it ends).
    admitted: bool = False
    # Tokens relayed to the client so far, and the usage chunks received.
    relayed: int = 0
    finals: list = field(default_factory=list)
    # The chunks' prompt tokens as the router counted them (for a request cut short).
    prompt_tokens: int = 0
    done: bool = False
    # The session the request is a turn of ("": none).
    session_id: str = ""
    # Sequences it runs (its prompts' n choices): what the concurrency quota counts.
    sequences: int = 1
    # Engine requests of it whose client left before their first chunk: each runs on to that chunk
    # (a future of it, None when none came), which is billed: the engine computed the prompt.
    abandoned: list = field(default_factory=list)
    # The cached tokens of each engine request, from its first chunk (its prompt as the engine took it).
    cached_prompts: int = 0
    # The LoRA adapter it is served with ("": the base model alone).
    adapter: str = ""

    def add(self, chunk: common_pb2.GenerateChunk) -> bool:
        """Count a chunk; True when it completes the request (every part has its usage)."""
        self.relayed += len(chunk.token_ids)
        if chunk.HasField("prefill"):
            self.cached_prompts += chunk.prefill.cached_tokens
        if chunk.HasField("usage"):
            self.finals.append(chunk)
        return len(self.finals) == self.parts and not self.done

    def event(self, outcome: str) -> UsageEvent:
        if self.finals and len(self.finals) == self.parts:
            prompt = sum(c.usage.prompt_tokens for c in self.finals)
            cached = sum(c.usage.cached_tokens for c in self.finals)
            completion = sum(c.usage.completion_tokens for c in self.finals)
        else:  # cut short: the prompts it was sent with (as cached as the engines said), and what it got
            prompt, cached, completion = self.prompt_tokens, self.cached_prompts, self.relayed
        last = self.finals[-1] if self.finals else None
        cost_in, cost_cached, cost_out = pricing.cost_parts(self.price, prompt, cached, completion)
        return UsageEvent(
            request_id=self.request_id, tenant=self.principal.tenant, key_id=self.principal.key_id,
            tier=self.principal.tier, model=self.model, model_version=self.model_version,
            prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
            cost_input_micros=cost_in, cost_cached_micros=cost_cached, cost_output_micros=cost_out, outcome=outcome,
            worker=",".join(sorted({c.worker_id for c in self.finals if c.worker_id})),
            finished_ms=metering.now_ms(),
            queue_ms=round(last.timings.queue_ms, 3) if last else 0.0,
            ttft_ms=round(last.timings.ttft_ms, 3) if last else 0.0,
            e2e_ms=round((time.perf_counter() - self.arrived) * 1000, 3),
            client_request_id=self.client_request_id, session_id=self.session_id, adapter=self.adapter,
        )


class Meter:
    def __init__(self, redis: Redis, spool_dir: Path, clock: Callable[[], int] = metering.now_ms,
                 local: "LocalQuotas | None" = None, streams_direct: bool = False) -> None:
        # Unix ms (tests move it).
        self._clock = clock
        self._redis = redis
        # This process's own count of what it admitted (a router's; None: it admits nothing).
        self.local = local
        self._admit = Script(redis, admission.ADMIT)
        self._record = Script(redis, admission.RECORD)
        self._release = Script(redis, admission.RELEASE)
        self._progress = Script(redis, admission.PROGRESS)
        # This process streams the direct path's requests (a worker's): each record marks its
        # request billed, and is skipped if the router billed it already (admission.RECORD's "own").
        self._mode = "own" if streams_direct else ""
        spool_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._spool = spool_dir / "usage.spool"
        self._spool_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.spooled = 0
        self._unchecked = False

    def precheck(self, principal: Principal) -> None:
        """Before a request's body is parsed: refused at once (ResourceExhausted) when this
        process's own count says its tenant cannot be admitted (LocalQuotas.check)."""
        if self.local is not None:
            self.local.check(principal)

    async def admit(
        self, principal: Principal, request_id: str, model: str, model_version: str, price: pricing.Price,
        prompt_tokens: int, max_completion_tokens: int, parts: int, client_request_id: str, arrived: float,
        sequences: int = 0, direct: bool = False,
    ) -> Metered:
        """Admit a request against its tenant's quotas and budget, reserving its place (sequences:
        its prompts' choices, parts by default), its tokens and its most possible cost;
        errors.ResourceExhausted (naming the limit, with when to retry) when one does not fit.
        direct: a worker will stream it (the direct path): its progress key is made with it."""
        m = Metered(request_id, principal, model, model_version, price, parts, client_request_id, arrived,
                    prompt_tokens=prompt_tokens, sequences=sequences or parts)
        estimate = pricing.estimate_micros(price, prompt_tokens, max_completion_tokens)
        tokens = prompt_tokens + max_completion_tokens
        now = self._clock()
        limits = principal.limits
        try:
            answer, a, b, c, retry_ms = await self._admit(
                keys=admission.admit_keys(principal.tenant, metering.month_of(now), request_id if direct else None),
                args=[request_id, estimate, tokens, now, now + RESERVATION_SECONDS * 1000, limits.rpm, limits.tpm,
                      limits.concurrency, m.sequences],
            )
        except RedisError as exc:
            if self.local is None:
                raise errors.Unavailable("quotas cannot be checked right now; retry shortly") from None
            # While Redis is away this process's own count admits, within bounds (LocalQuotas).
            if not self._unchecked:
                log.warning("cannot check quotas and budgets in Redis (%s); admitting by this router's own count "
                            "until it answers", exc)
            self._unchecked = True
            self.local.admit_degraded(m, tokens, estimate, now)
            return m
        if self._unchecked:
            log.info("Redis answers again; quotas and budgets are checked")
            self._unchecked = False
        if answer != admission.ADMITTED:
            err = refusal(principal.tenant, answer, a, b, c, retry_ms, estimate, tokens, now)
            if self.local is not None:
                self.local.refused(principal.tenant, answer, err)
            raise err
        m.admitted = True
        if self.local is not None:
            self.local.admitted(m, tokens, None if a < 0 else a - b - c - estimate)
        return m

    def ended(self, m: Metered) -> None:
        """A request this process admitted is over, whoever metered it (a worker, on the direct path)."""
        if self.local is not None:
            self.local.ended(m)

    async def commit(self, m: Metered, outcome: str) -> None:
        """Append the request's usage event (spooled when Redis does not answer). Once per request.
        Engine requests its client left before their first chunk are waited for (they run on to
        it): the prompt an engine computed is billed, whatever the client did."""
        if m.done:
            return
        m.done = True
        for first in await asyncio.gather(*m.abandoned, return_exceptions=True):
            if isinstance(first, common_pb2.GenerateChunk):
                m.add(first)
        self.ended(m)
        if not m.finals and not m.relayed:  # ended before producing anything: nothing to bill
            await self.release(m)
            return
        await self._commit_event(m.event(outcome), self._mode)

    async def _commit_event(self, event: UsageEvent, mode: str) -> None:
        try:
            keys, args = admission.record_args(event, mode)
            await self._record(keys=keys, args=args)
        except RedisError as exc:
            if mode == "claim":  # (the worker's own record, or its progress, is what there is)
                log.warning("cannot bill %s for what its worker sent before it went silent (%s)", event.request_id, exc)
                return
            log.warning("cannot append usage of %s to Redis (%s); spooled until it answers", event.request_id, exc)
            await self._write_spool(event)

    async def claim(self, m: Metered) -> None:
        """A direct request whose worker went silent (no report of its end): billed for what the
        worker's last progress says its client was sent (its prompt too once a worker took it: the
        engine computes what it was given), unless the worker billed it (it is then only out of
        this process's count); one no worker took gives its reservation back."""
        if m.done:
            return
        try:
            value = await self._redis.get(admission.progress_key(m.principal.tenant, m.request_id))
        except RedisError:
            value = None
        progress = admission.read_progress(value)
        if progress is None or not (progress[0] or admission.progress_worker(value)):
            await self.release(m)
            return
        m.done = True
        m.relayed, m.cached_prompts = progress
        self.ended(m)
        await self._commit_event(m.event("failed"), "claim")

    def claim_later(self, m: Metered) -> None:
        """claim() from a request being given up: runs to its end regardless."""
        task = asyncio.create_task(self.claim(m))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def write_progress(self, streams: list[Metered], worker: str) -> None:
        """What the clients of these direct requests have been sent so far, by this worker, for
        the router to bill should it die (admission.PROGRESS); one round trip for all of them."""
        if not streams:
            return
        for attempt in range(2):
            pipe = self._redis.pipeline(transaction=False)
            for m in streams:
                pipe.evalsha(self._progress.sha, 1, admission.progress_key(m.principal.tenant, m.request_id),
                             admission.progress_value(m.relayed, m.cached_prompts, worker))
            try:
                await pipe.execute()
                return
            except NoScriptError:  # a restarted Redis: load it, once
                if attempt:
                    return
                try:
                    await self._progress.load()
                except RedisError:
                    return
            except RedisError as exc:
                log.debug("cannot write the progress of %d streams (%s)", len(streams), exc)
                return

    def commit_later(self, m: Metered, outcome: str) -> None:
        """commit() from a request being torn down (a cancelled stream): runs to its end regardless."""
        task = asyncio.create_task(self.commit(m, outcome))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def release_later(self, m: Metered, used_tokens: int = 0) -> None:
        """release() from a request being torn down: runs to its end regardless."""
        task = asyncio.create_task(self.release(m, used_tokens))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def release(self, m: Metered, used_tokens: int = 0) -> None:
        """A request ends without a usage event: its place and reserved tokens go back, less
        used_tokens (the tokens of a /tokenize, which count against the minute's quota)."""
        self.ended(m)
        if not m.admitted:
            return
        try:
            await self._release(keys=admission.release_keys(m.principal.tenant), args=[m.request_id, used_tokens])
        except RedisError:
            pass  # the reservation lapses on its own

    # ------------------------------------------------------------ the spool

    async def _write_spool(self, event: UsageEvent) -> None:
        line = (json.dumps(asdict(event)) + "\n").encode()
        async with self._spool_lock:
            await asyncio.to_thread(_append_synced, self._spool, line)
            self.spooled += 1

    async def drain_spool(self) -> int:
        """Append the spooled events to Redis; returns how many went (0 while Redis is away)."""
        async with self._spool_lock:
            if not self._spool.exists():
                return 0
            lines = self._spool.read_text().splitlines()
            sent = 0
            try:
                for line in lines:
                    event = UsageEvent(**json.loads(line))
                    keys, args = admission.record_args(event, self._mode)
                    await self._record(keys=keys, args=args)
                    sent += 1
            except RedisError:
                rest = lines[sent:]
                self._spool.write_text("".join(x + "\n" for x in rest))
                return sent
            self._spool.unlink()
            if sent:
                log.info("appended %d spooled usage events to Redis", sent)
            return sent

    async def run_spool(self, every_seconds: float = 2.0) -> None:
        """Keep draining the spool until cancelled."""
        while True:
            await self.drain_spool()
            await asyncio.sleep(every_seconds)

    async def close(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def metered(meter: Meter | None, m: Metered | None, items, chunk_of=lambda item: item, on_last=None):
    """Relay items (chunks, or what carries them), appending the request's usage event before its
    last chunk is released; a request cut short (the client went away, a worker failed after
    tokens) is metered for what was produced, and one that produced nothing releases its budget
    reservation. Writing the usage event is the tenant's time: it is added to that chunk's latency
    decomposition (gaas.contracts.latency), and on_last(chunk) is told each final chunk once complete."""
    if meter is None or m is None:
        async for item in items:
            if on_last is not None and chunk_of(item).HasField("usage"):
                on_last(chunk_of(item))
            yield item
        return
    outcome = "failed"
    try:
        async for item in items:
            chunk = chunk_of(item)
            if m.add(chunk):
                started = time.perf_counter()
                await meter.commit(m, "finished")
                latency.add_tenant(chunk.timings, time.perf_counter() - started)
            if on_last is not None and chunk.HasField("usage"):
                on_last(chunk)
            yield item
        outcome = "finished"
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "cancelled"
        raise
    finally:
        if not m.done:
            meter.commit_later(m, outcome)


def refusal(
    tenant: str, answer: int, a: int, b: int, c: int, retry_ms: int, estimate: int, tokens: int, now: int,
) -> errors.ResourceExhausted:
    """The error of an ADMIT answer that refused a request (its figures as the script returned them)."""
    retry = max(1.0, retry_ms / 1000)
    subject = f"tenant:{tenant}"
    if answer == admission.OVER_CONCURRENCY:
        return errors.ResourceExhausted(
            f"tenant {tenant} has {a} sequences in flight (each choice of each prompt counts), its limit is {b} at "
            "once: retry when one has finished", reason="rate_limit_exceeded", retry_after=retry,
            quota=errors.QuotaViolation(subject, f"concurrent sequences: {b}"))
    if answer == admission.TOO_MANY_SEQUENCES:
        return errors.ResourceExhausted(
            f"this request runs {a} sequences at once (n choices of each prompt), more than tenant {tenant}'s "
            f"limit of {b}: ask for fewer choices or send fewer prompts", param="n", reason="rate_limit_exceeded",
            quota=errors.QuotaViolation(subject, f"concurrent sequences: {b}"))
    if answer == admission.OVER_RPM:
        return errors.ResourceExhausted(
            f"tenant {tenant} has made {a} requests in the last minute, its quota is {b} requests per minute: "
            f"retry in {retry:.0f} s", reason="rate_limit_exceeded", retry_after=retry,
            quota=errors.QuotaViolation(subject, f"requests per minute: {b}"))
    if answer == admission.OVER_TPM:
        return errors.ResourceExhausted(
            f"tenant {tenant} has used {a} tokens in the last minute (prompts plus the most each request may "
            f"generate), its quota is {b} tokens per minute and this request needs up to {tokens}: retry in "
            f"{retry:.0f} s, or ask for fewer max_tokens", reason="rate_limit_exceeded", retry_after=retry,
            quota=errors.QuotaViolation(subject, f"tokens per minute: {b}"))
    if answer == admission.TOO_LARGE_FOR_TPM:
        return errors.ResourceExhausted(
            f"this request needs up to {a} tokens (its prompt plus max_tokens), more than tenant {tenant}'s quota "
            f"of {b} tokens per minute: ask for fewer max_tokens or a shorter prompt", param="max_tokens",
            reason="rate_limit_exceeded", quota=errors.QuotaViolation(subject, f"tokens per minute: {b}"))
    _, month_end = metering.month_bounds(metering.month_of(now))
    return errors.ResourceExhausted(
        f"tenant {tenant} has used its monthly budget of {pricing.format_usd(a)} ({pricing.format_usd(b)} spent "
        f"this month, {pricing.format_usd(c)} held by requests in flight; this request could cost up to "
        f"{pricing.format_usd(estimate)}); requests are served again when the budget is raised or the month turns",
        reason="insufficient_quota", retry_after=max(1.0, (month_end - now) / 1000),
        quota=errors.QuotaViolation(subject, f"monthly budget: {pricing.format_usd(a)}"))


# While Redis is away, a tenant whose own quota is unlimited (0) is admitted by each router up to
# these (sequences at once, requests a minute): bounded, never unlimited for everyone.
DEGRADED_CONCURRENCY = 16
DEGRADED_RPM = 600


@dataclass(slots=True)
class _Seen:
    """What one process admitted for one tenant."""

    # Sequences in flight, by request id.
    in_flight: dict = field(default_factory=dict)
    # (when, tokens) of each request admitted within the last minute (monotonic seconds).
    admitted: deque = field(default_factory=deque)
    # Refused by the requests-per-minute quota until then (monotonic), and the refusal.
    refused_until: float = 0.0
    refusal: errors.ResourceExhausted | None = None
    # Its monthly budget's room when Redis last admitted one of its requests (micro-dollars; None:
    # no budget, or not known), less what was admitted without Redis since.
    headroom: int | None = None


class LocalQuotas:
    """One process's own count of what it admitted, per tenant: the sequences it has in flight and
    the requests and tokens it admitted in the last minute. Every router draws from the tenant's
    quotas in Redis, so its own count is a lower bound of the whole: a request its tenant is over
    by this count alone (or that Redis refused on the requests-per-minute quota, until the refusal's
    retry time) is refused before its body is parsed, sessions are read or its prompt is tokenized.

    While Redis does not answer, this count admits: the tenant's own quotas (or DEGRADED_* where
    they are unlimited), counted per router, and its budget's room as Redis last reported it, less
    what was admitted since (a tenant not seen since the router started is admitted within the
    quotas; what it uses is metered, spooled, and billed once Redis is back)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window: float = 60.0,
                 degraded_concurrency: int = DEGRADED_CONCURRENCY, degraded_rpm: int = DEGRADED_RPM) -> None:
        self._clock = clock
        self._window = window
        self._degraded = (degraded_concurrency, degraded_rpm)
        self._tenants: dict[str, _Seen] = {}

    def _seen(self, tenant: str) -> _Seen:
        s = self._tenants.get(tenant)
        if s is None:
            s = self._tenants[tenant] = _Seen()
        return s

    def _recent(self, s: _Seen) -> deque:
        horizon = self._clock() - self._window
        while s.admitted and s.admitted[0][0] <= horizon:
            s.admitted.popleft()
        return s.admitted

    def check(self, principal: Principal, sequences: int = 1, degraded: tuple[int, int, int] | None = None) -> None:
        """Refuse (ResourceExhausted) what this count alone says cannot be admitted: sequences more
        at once, one request more this minute. degraded: (concurrency, rpm, tpm) to admit by while
        Redis is away, tokens included (this count reserves each request's most, which Redis
        settles to what it used: a lower bound of the whole only then)."""
        s = self._tenants.get(principal.tenant)
        if s is None:
            if degraded is None:
                return
            s = _Seen()
        now = self._clock()
        if s.refusal is not None and now < s.refused_until:
            raise errors.ResourceExhausted(s.refusal.message, reason=s.refusal.reason,
                                           retry_after=max(1.0, s.refused_until - now), quota=s.refusal.quota)
        concurrency, rpm, tpm = degraded or (principal.limits.concurrency, principal.limits.rpm, 0)
        running = sum(s.in_flight.values())
        if concurrency and running + sequences > concurrency:
            raise refusal(principal.tenant, admission.OVER_CONCURRENCY, running, concurrency, 0, 1000, 0, 0, 0)
        recent = self._recent(s)
        if rpm and len(recent) >= rpm:
            retry_ms = int((recent[-rpm][0] + self._window - now) * 1000)
            raise refusal(principal.tenant, admission.OVER_RPM, len(recent), rpm, 0, retry_ms, 0, 0, 0)
        if tpm and (used := sum(t for _, t in recent)) >= tpm:
            retry_ms = int((recent[0][0] + self._window - now) * 1000)
            raise refusal(principal.tenant, admission.OVER_TPM, used, tpm, 0, retry_ms, 0, 0, 0)

    def admitted(self, m: Metered, tokens: int, headroom: int | None) -> None:
        s = self._seen(m.principal.tenant)
        s.in_flight[m.request_id] = m.sequences
        s.admitted.append((self._clock(), tokens))
        s.headroom = headroom
        s.refusal = None

    def refused(self, tenant: str, answer: int, err: errors.ResourceExhausted) -> None:
        """Redis refused a request: on the requests-per-minute quota the refusal holds until its
        retry time (only more requests can come before then); the others depend on the request."""
        if answer == admission.OVER_RPM and err.retry_after:
            s = self._seen(tenant)
            s.refusal, s.refused_until = err, self._clock() + err.retry_after

    def ended(self, m: Metered) -> None:
        s = self._tenants.get(m.principal.tenant)
        if s is None:
            return
        s.in_flight.pop(m.request_id, None)
        if not s.in_flight and not self._recent(s) and s.headroom is None and s.refusal is None:
            del self._tenants[m.principal.tenant]

    def admit_degraded(self, m: Metered, tokens: int, estimate: int, now_ms: int) -> None:
        """Admit without Redis, by this process's count (ResourceExhausted when over)."""
        limits = m.principal.limits
        d_concurrency, d_rpm = self._degraded
        self.check(m.principal, m.sequences, (limits.concurrency or d_concurrency, limits.rpm or d_rpm, limits.tpm))
        s = self._seen(m.principal.tenant)
        if s.headroom is not None:
            if estimate > s.headroom:
                raise errors.ResourceExhausted(
                    f"tenant {m.principal.tenant}'s monthly budget has no room left for this request as last "
                    f"counted, and it cannot be counted again right now: retry shortly", reason="insufficient_quota",
                    retry_after=5.0, quota=errors.QuotaViolation(f"tenant:{m.principal.tenant}", "monthly budget"))
            s.headroom -= estimate
        s.in_flight[m.request_id] = m.sequences
        s.admitted.append((self._clock(), tokens))


def _append_synced(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


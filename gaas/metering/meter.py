"""Admission and metering, shared by whoever serves a request (the router, or a worker the ingress
sent it to straight): a tenant's quotas and budget checked (and the
request's place, tokens and most possible cost reserved; gaas.metering.admission) before a request starts,
and one usage event appended to the Redis Stream when it ends, before its last chunk is released:
finished, cancelled by the client, or failed after tokens were produced. A request retried on a
second worker before its first token is one event.

Beside Redis, the process that admits (a router) keeps its own count of what it admitted for each
tenant (gaas.metering.local.LocalQuotas): a request its tenant cannot be admitted for by this
process's count alone is refused before its body is parsed or tokenized (cheap refusals first), and
while Redis does not answer, that count admits by the tenant's own quotas shared among the routers.
After a failure Redis is not asked again for a moment (gaas.metering.circuit: the fallback costs
no wait), then one request tries it, and Redis admits again from the first answer.

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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from gaas.contracts import errors, latency, pricing, usage as metering
from gaas.metering import admission
from gaas.metering.circuit import RedisCircuit
from gaas.contracts.usage import UsageEvent
from gaas.runtime.redisconn import Script
from gaas.v1 import common_pb2
from gaas.contracts.principal import Principal

if TYPE_CHECKING:
    from gaas.metering.local import LocalQuotas

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
                 local: LocalQuotas | None = None, streams_direct: bool = False,
                 circuit: RedisCircuit | None = None) -> None:
        # Unix ms (tests move it).
        self._clock = clock
        self._redis = redis
        # This process's own count of what it admitted (a router's; None: it admits nothing).
        self.local = local
        # Whether Redis is asked right now (not for a moment after it failed).
        self._circuit = circuit or RedisCircuit()
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
        if not self._circuit.allows():  # Redis failed a moment ago: not asked until it is tried again
            return self._admit_without_redis(m, tokens, estimate)
        try:
            answer, a, b, c, retry_ms = await self._admit(
                keys=admission.admit_keys(principal.tenant, metering.month_of(now), request_id if direct else None),
                args=[request_id, estimate, tokens, now, now + RESERVATION_SECONDS * 1000, limits.rpm, limits.tpm,
                      limits.concurrency, m.sequences],
            )
        except RedisError as exc:
            self._circuit.failed()
            if not self._unchecked:
                log.warning("cannot check quotas and budgets in Redis (%s); %s until it answers", exc,
                            "refusing" if self.local is None else "admitting by this router's own count")
            self._unchecked = True
            return self._admit_without_redis(m, tokens, estimate)
        except BaseException:
            self._circuit.abandoned()
            raise
        self._circuit.succeeded()
        if self._unchecked:
            log.info("Redis answers again; quotas and budgets are checked")
            self._unchecked = False
        if answer != admission.ADMITTED:
            err = admission.refusal(principal.tenant, answer, a, b, c, retry_ms, estimate, tokens, now)
            if self.local is not None:
                self.local.refused(principal.tenant, answer, err)
            raise err
        m.admitted = True
        if self.local is not None:
            self.local.admitted(m, tokens, None if a < 0 else a - b - c - estimate)
        return m

    def _admit_without_redis(self, m: Metered, tokens: int, estimate: int) -> Metered:
        """While Redis does not answer: this process's own count admits (LocalQuotas.admit_degraded)."""
        if self.local is None:
            raise errors.Unavailable("quotas cannot be checked right now; retry shortly")
        self.local.admit_degraded(m, tokens, estimate)
        return m

    def ended(self, m: Metered, used_tokens: int | None = None) -> None:
        """A request this process admitted is over, whoever metered it (a worker, on the direct
        path); used_tokens: its prompt and completion tokens, when known."""
        if self.local is not None:
            self.local.ended(m, used_tokens)

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
        if not m.finals and not m.relayed:  # ended before producing anything: nothing to bill
            await self.release(m)
            return
        event = m.event(outcome)
        self.ended(m, event.prompt_tokens + event.completion_tokens)
        await self._commit_event(event, self._mode)

    async def _commit_event(self, event: UsageEvent, mode: str) -> None:
        """Append a usage event; spooled when Redis does not answer, or failed a moment ago (the
        client's last chunk does not wait for it: the spool appends it once Redis is back)."""
        if mode != "claim" and not self._circuit.allows():
            log.warning("cannot append usage of %s to Redis (it failed a moment ago); spooled until it answers",
                        event.request_id)
            await self._write_spool(event)
            return
        try:
            await self._append(event, mode)
            self._circuit.succeeded()
        except asyncio.CancelledError:
            self._circuit.abandoned()
            raise
        except RedisError as exc:
            self._circuit.failed()
            if mode == "claim":  # (the worker's own record, or its progress, is what there is)
                log.warning("cannot bill %s for what its worker sent before it went silent (%s)", event.request_id, exc)
                return
            log.warning("cannot append usage of %s to Redis (%s); spooled until it answers", event.request_id, exc)
            await self._write_spool(event)

    async def _append(self, event: UsageEvent, mode: str) -> None:
        """RECORD an event (RedisError passes). A worker's own of a request billed already bills
        what its attempt sent beyond what was billed (admission.supplement), against the billed
        value it read (read again should another attempt's record change it meanwhile)."""
        keys, args = admission.record_args(event, mode)
        billed = await self._record(keys=keys, args=args)
        while mode == "own" and admission.is_billed(billed) and (more := admission.supplement(event, billed)):
            keys, args = admission.record_args(more, "more", billed)
            if await self._record(keys=keys, args=args):
                return
            keys, args = admission.record_args(event, mode)
            billed = await self._record(keys=keys, args=args)

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
        event = m.event("failed")
        self.ended(m, event.prompt_tokens + event.completion_tokens)
        await self._commit_event(event, "claim")

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
        self.ended(m, used_tokens)
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
                    await self._append(event, self._mode)
                    sent += 1
            except RedisError:
                rest = lines[sent:]
                self._spool.write_text("".join(x + "\n" for x in rest))
                return sent
            self._spool.unlink()
            self._circuit.succeeded()
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


def _append_synced(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


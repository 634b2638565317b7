"""Usage events from the Redis Stream into the ledger, exactly once per request: read with a
consumer group, written (idempotently, by request id), and only then acknowledged and deleted.
A consumer that restarts first re-reads what it had read but not acknowledged; events a dead
consumer held are claimed by another after a while. An entry that is not a usage event is kept
aside in the ledger's dead letters, never dropped and never allowed to block the stream."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from gaas.contracts.usage import GROUP, STREAM, UsageEvent
from services.billing.ledger import Ledger

log = logging.getLogger(__name__)

# Once events arrive, those that follow within this are read too and written to the ledger with
# them (one read, one transaction, one acknowledgement), so billing's cost per event does not
# depend on how requests arrive (one at a time, each would be all of these alone). What it adds to
# metering's lag, at most.
GATHER_SECONDS = 0.5


class UsageConsumer:
    def __init__(
        self,
        redis: Redis,
        ledger: Ledger,
        consumer: str,
        batch: int = 500,
        claim_idle_ms: int = 30_000,
        on_recorded: Callable[[int, list[UsageEvent]], None] = lambda new, events: None,
        gather_s: float = GATHER_SECONDS,
    ) -> None:
        self._redis = redis
        self._ledger = ledger
        self._consumer = consumer
        self._batch = batch
        self._claim_idle_ms = claim_idle_ms
        self._on_recorded = on_recorded
        self._gather_s = gather_s
        # Whether entries this consumer read and did not acknowledge may be waiting (it started, or
        # a round failed): read them first.
        self._recheck = True
        self.recorded = 0
        self.duplicates = 0

    async def ensure_group(self) -> None:
        """Create the usage stream and its consumer group unless they exist (run() does it first, and again
        after Redis lost them); idempotent."""
        try:
            await self._redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _handle(self, entries) -> int:
        """Write a batch of stream entries to the ledger, then acknowledge and delete them."""
        if not entries:
            return 0
        events, ids = [], []
        for entry_id, fields in entries:
            ids.append(entry_id)
            if not fields:  # deleted before we read it
                continue
            try:
                events.append(UsageEvent.from_fields(fields))
            except (ValueError, TypeError) as exc:
                log.error("stream entry %s is not a usage event (%s); kept aside in dead_letters", entry_id, exc)
                await self._ledger.dead_letter(str(entry_id), repr(fields)[:10_000], str(exc))
        new = await self._ledger.record(events)
        self.recorded += new
        self.duplicates += len({e.request_id for e in events}) - new
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(STREAM, GROUP, *ids)
            pipe.xdel(STREAM, *ids)
            await pipe.execute()
        self._on_recorded(new, events)
        return len(ids)

    async def step(self, block_ms: int = 1000) -> int:
        """One round: what this consumer had read and not acknowledged (once it starts, and after
        a round failed), else new entries: those that came within gather_s of the first, at once."""
        if self._recheck:
            pending = await self._redis.xreadgroup(GROUP, self._consumer, {STREAM: "0"}, count=self._batch)
            handled = 0
            for _, entries in pending or ():
                handled += await self._handle(entries)
            if handled:
                return handled
            self._recheck = False
        fresh = await self._redis.xreadgroup(GROUP, self._consumer, {STREAM: ">"}, count=self._batch, block=block_ms)
        entries = [e for _, es in fresh or () for e in es]
        if entries and len(entries) < self._batch and self._gather_s > 0:
            await asyncio.sleep(self._gather_s)
            more = await self._redis.xreadgroup(GROUP, self._consumer, {STREAM: ">"}, count=self._batch - len(entries))
            entries += [e for _, es in more or () for e in es]
        try:
            return await self._handle(entries)
        except BaseException:
            self._recheck = True
            raise

    async def claim(self) -> int:
        """Take over entries another consumer read and left unacknowledged for claim_idle_ms."""
        handled, start = 0, "0-0"
        while True:
            start, entries, *_ = await self._redis.xautoclaim(
                STREAM, GROUP, self._consumer, self._claim_idle_ms, start_id=start, count=self._batch
            )
            if entries:
                log.info("claimed %d usage events a dead consumer had left", len(entries))
                handled += await self._handle(entries)
            if not entries or start in (b"0-0", "0-0"):
                return handled

    async def backlog(self) -> int:
        """Entries in the stream not yet recorded."""
        try:
            return int(await self._redis.xlen(STREAM))
        except RedisError:
            return -1

    async def run(self, claim_every_seconds: float = 10.0) -> None:
        """Consume until cancelled; Redis being away (or restarted) is waited out."""
        failing = False
        last_claim = 0.0
        ready = False
        while True:
            try:
                if not ready:
                    await self.ensure_group()
                    ready = True
                if time.monotonic() - last_claim > claim_every_seconds:
                    last_claim = time.monotonic()
                    await self.claim()
                await self.step()
                if failing:
                    log.info("Redis answers again; consuming usage events")
                failing = False
            except ResponseError as exc:
                ready = False
                self._recheck = True
                # A Redis that lost the stream and its group (restarted without its data, or the key
                # deleted while we waited on it): create the group again and read from the start.
                if str(exc).startswith(("NOGROUP", "UNBLOCKED")):
                    log.warning("the usage stream's consumer group was gone (%s); created again", exc)
                    continue
                log.error("Redis refused a usage-stream command (%s); retrying", exc)
                await asyncio.sleep(1.0)
            except (RedisError, OSError) as exc:
                if not failing:
                    log.warning("cannot read usage events (%s); retrying", exc)
                failing = True
                ready = False
                self._recheck = True
                await asyncio.sleep(1.0)

"""The router's queue of requests that no worker can take yet (every window full): ordered by
priority band, fair between tenants within a band (round robin over the tenants waiting), bounded
(a full queue sheds the newest request of its lowest band below the newcomer's, else refuses the
newcomer), and with deadlines (a request that waits past its tier's queue timeout, or its gRPC
deadline, gets DEADLINE_EXCEEDED).

Placing is synchronous (the scheduler is pure): whenever room may have appeared (a request ended,
one joined), dispatch() offers it to the waiters in order; each waiter's place() schedules it and
takes the room, or says there is none.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gaas.contracts import errors
from gaas.contracts.qos import BAND_NAMES


@dataclass(eq=False, slots=True)
class Waiter:
    band: int
    tenant: str
    # What it needs room on (waiters of a model found without room are not asked again in a round).
    model: str
    # Schedule the request and take its room: what to hand it, or None when there is no room.
    place: Callable[[], object]
    future: asyncio.Future
    seq: int
    since: float


@dataclass(slots=True)
class BandStats:
    waiting: int = 0
    admitted: int = 0
    queued: int = 0
    shed: int = 0
    timed_out: int = 0
    # Recent waits, seconds (for the p95 gaas status shows).
    waits: deque = field(default_factory=lambda: deque(maxlen=256))


class WaitQueue:
    def __init__(self, max_waiting: int = 256, clock: Callable[[], float] = time.monotonic) -> None:
        self._max = max_waiting
        self._clock = clock
        # band -> tenant -> its waiters in arrival order; tenants rotate as they are served.
        self._bands: list[OrderedDict[str, deque[Waiter]]] = [OrderedDict() for _ in BAND_NAMES]
        self._seq = itertools.count()
        self.stats = [BandStats() for _ in BAND_NAMES]

    def __len__(self) -> int:
        return sum(s.waiting for s in self.stats)

    def ahead(self, band: int) -> bool:
        """Whether requests of this band or a better one are waiting (a newcomer queues behind them)."""
        return any(self.stats[b].waiting for b in range(band + 1))

    async def wait(self, band: int, tenant: str, model: str, deadline: float, place: Callable[[], object],
                   why_deadline: str, abandon: Callable[[object], None]) -> object:
        """Queue until place() succeeds (its result is returned); errors.DeadlineExceeded at the
        deadline (clock time), errors.Unavailable when shed to make room for a better band. A
        caller that goes away after being placed gives its room back through abandon(result)."""
        loop = asyncio.get_running_loop()
        waiter = Waiter(band, tenant, model, place, loop.create_future(), next(self._seq), self._clock())
        self._admit_to_queue(waiter)
        self.dispatch()

        def expire() -> None:
            if waiter.future.done():
                return
            self._remove(waiter)
            self.stats[band].timed_out += 1
            waiter.future.set_exception(errors.DeadlineExceeded(
                f"no worker could take the request within {self._clock() - waiter.since:.1f} s ({why_deadline}); "
                "the mesh is busy: retry later", retry_after=1.0,
            ))

        timer = loop.call_later(max(0.0, deadline - self._clock()), expire)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._remove(waiter)
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                abandon(waiter.future.result())  # placed just as the caller went away
            raise
        finally:
            timer.cancel()

    def _admit_to_queue(self, waiter: Waiter) -> None:
        if len(self) >= self._max:
            victim = self._newest_below(waiter.band)
            if victim is None:
                self.stats[waiter.band].shed += 1
                raise _overloaded(waiter.band)
            self._remove(victim)
            self.stats[victim.band].shed += 1
            victim.future.set_exception(_overloaded(victim.band))
        self._bands[waiter.band].setdefault(waiter.tenant, deque()).append(waiter)
        self.stats[waiter.band].waiting += 1
        self.stats[waiter.band].queued += 1

    def _newest_below(self, band: int) -> Waiter | None:
        for b in range(len(BAND_NAMES) - 1, band, -1):
            waiters = [w for q in self._bands[b].values() for w in q]
            if waiters:
                return max(waiters, key=lambda w: w.seq)
        return None

    def _remove(self, waiter: Waiter) -> None:
        tenants = self._bands[waiter.band]
        q = tenants.get(waiter.tenant)
        if q is not None and waiter in q:
            q.remove(waiter)
            self.stats[waiter.band].waiting -= 1
            if not q:
                del tenants[waiter.tenant]

    def dispatch(self) -> int:
        """Offer whatever room there is to the waiters, best band first, tenants in turn; returns
        how many were placed."""
        placed = 0
        full_models: set[str] = set()
        for band, tenants in enumerate(self._bands):
            progress = True
            while tenants and progress:
                progress = False
                for tenant in list(tenants):
                    q = tenants.get(tenant)
                    if not q:
                        continue
                    waiter = q[0]
                    if waiter.model in full_models:
                        continue
                    if waiter.future.done():  # timed out or cancelled meanwhile
                        self._remove(waiter)
                        continue
                    result = waiter.place()
                    if result is None:
                        full_models.add(waiter.model)
                        continue
                    self._remove(waiter)
                    if tenant in tenants:
                        tenants.move_to_end(tenant)  # the next tenant's turn
                    stats = self.stats[band]
                    stats.admitted += 1
                    stats.waits.append(self._clock() - waiter.since)
                    waiter.future.set_result(result)
                    placed += 1
                    progress = True
        return placed


def _overloaded(band: int) -> errors.Unavailable:
    return errors.Unavailable(
        f"every worker is busy and the queue is full: this {BAND_NAMES[band]} request was shed so that higher "
        "tiers are served; retry in a few seconds", reason="overloaded", retry_after=2.0,
    )

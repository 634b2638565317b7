"""The dynamic batching window: per worker, how many requests this router keeps in its engine at
once, adapted to the time to first token it observes there (SITS2026's dynamic batching
dimension, on top of vLLM's own max_num_seqs / max_num_batched_tokens).

Each tier has a TTFT target (deploy/gaas.yaml, qos). When a tier's p95 TTFT on a worker passes its
target, that worker's window halves; when every tier is under 80% of its target while the window
was full, it grows by a fifth (at least one); it grows too while every tier meets its target but
a gold request found no room (gold waiting in the router's queue costs gold more than a fuller
batch would). Growing needs every tier seen in the last SAMPLE_SECONDS to have shown its p95 since
the last change: a tier of few requests (gold beside a flood of bronze) would otherwise never have
enough samples to count, and the flood's own fast first tokens would grow the window, change after
change, past what the quiet tier's target allows. Priority bands share a window unequally: bronze
may fill half of it, silver three quarters, so a flood of bronze never takes the room a gold
request needs; gold may go past it, to twice the window, for the same reason: a window shrunk for
gold's own target throttles the lower bands, not gold (measured: with gold held to the window, gold
waited in the router's queue and its p95 TTFT at twice the fleet's load was 142 ms; allowed past
it, 94 ms and no waits).
Requests that find no room wait in the router's queue (services/router/waitqueue.py), in band
order.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gaas.runtime.metrics import nearest_rank
from gaas.contracts.ids import WorkerId

# Share of a worker's window each band may fill (gold, silver, bronze, batch): gold past it. The
# tiers count their own requests only (a batch request never keeps one of theirs waiting: the
# engine's priorities serve theirs first); the batch band counts every request, so it fills only
# what the tiers leave of half the window.
BAND_SHARE = (2.0, 0.75, 0.5, 0.5)
BATCH_BAND = len(BAND_SHARE) - 1
# Samples a tier needs in the recent past before its p95 counts.
MIN_SAMPLES = 8
SAMPLE_SECONDS = 10.0
# At most one change per this long (the last change must show in new samples first).
ADJUST_EVERY_SECONDS = 1.0
# Grow a full window while every tier's p95 is under this share of its target.
GROW_BELOW = 0.8
# The p95s are worked out at most this often per worker (each scans the recent samples; at every
# first token they took a busy router ~3% of its time).
EVALUATE_EVERY_SECONDS = 0.1


@dataclass(slots=True)
class Window:
    limit: float
    # Requests sent and not ended: all of them, and of those the batch band's.
    in_flight: int = 0
    batch_in_flight: int = 0
    # Whether a request found it full since the last change (growing an unused window proves nothing).
    full: bool = False
    # Whether a gold (band 0) request found no room since the last change.
    starved: bool = False
    changed_at: float = 0.0
    evaluated_at: float = 0.0
    samples: deque = field(default_factory=lambda: deque(maxlen=512))  # (time, tier, ttft ms)
    shrinks: int = 0
    grows: int = 0

    def room(self, band: int) -> int:
        counted = self.in_flight if band == BATCH_BAND else self.in_flight - self.batch_in_flight
        return max(0, math.floor(self.limit * BAND_SHARE[band] + 1e-9) - counted)

    def verdicts(self, targets: Mapping[str, float], since: float, recent: float) -> tuple[list[float], bool]:
        """Each tier's p95 TTFT since `since` over its target, for the tiers with MIN_SAMPLES of them;
        and whether every tier with a sample since `recent` (<= since) is among them (what growing needs)."""
        values: dict[str, list[float]] = {}
        active: set[str] = set()
        for t, tier, ms in self.samples:
            if t >= recent:
                active.add(tier)
                if t >= since:
                    values.setdefault(tier, []).append(ms)
        ratios, proven = [], True
        for tier in active & targets.keys():
            mine = values.get(tier, ())
            if len(mine) >= MIN_SAMPLES:
                ratios.append(nearest_rank(mine, 0.95) / targets[tier])
            else:
                proven = False
        return ratios, proven


class Windows:
    def __init__(
        self, targets_ms: Mapping[str, float], *, initial: int = 8, minimum: int = 2, maximum: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._targets = dict(targets_ms)
        self._initial, self._min, self._max = initial, minimum, maximum
        self._clock = clock
        self._windows: dict[WorkerId, Window] = {}

    def _get(self, worker: WorkerId) -> Window:
        w = self._windows.get(worker)
        if w is None:
            w = self._windows[worker] = Window(float(self._initial), changed_at=self._clock())
        return w

    def room(self, workers: Iterable[WorkerId], band: int) -> dict[WorkerId, int]:
        """Requests of this band each worker can take now."""
        out = {}
        for worker in workers:
            w = self._get(worker)
            out[worker] = w.room(band)
            if out[worker] == 0 and band != BATCH_BAND:
                w.full = True
                w.starved = w.starved or band == 0
        return out

    def acquire(self, worker: WorkerId, batch: bool = False) -> None:
        w = self._get(worker)
        w.in_flight += 1
        w.batch_in_flight += batch
        if w.in_flight - w.batch_in_flight >= math.floor(w.limit):
            w.full = True

    def release(self, worker: WorkerId, batch: bool = False) -> None:
        w = self._get(worker)
        w.in_flight = max(0, w.in_flight - 1)
        if batch:
            w.batch_in_flight = max(0, w.batch_in_flight - 1)

    def observe(self, worker: WorkerId, tier: str, ttft_ms: float) -> None:
        """A request of tier got its first token from worker after ttft_ms: maybe adjust the window."""
        w = self._get(worker)
        now = self._clock()
        w.samples.append((now, tier, ttft_ms))
        if now - w.changed_at < ADJUST_EVERY_SECONDS or now - w.evaluated_at < EVALUATE_EVERY_SECONDS:
            return
        w.evaluated_at = now
        recent = now - SAMPLE_SECONDS
        ratios, proven = w.verdicts(self._targets, max(w.changed_at, recent), recent)
        if not ratios:
            return
        if max(ratios) > 1.0:
            self.shrink(worker)
        elif proven and (w.starved or (max(ratios) < GROW_BELOW and w.full)):
            self._grow(w, now)

    def _grow(self, w: Window, now: float) -> None:
        if w.limit < self._max:
            w.limit = min(float(self._max), max(w.limit + 1, w.limit * 1.2))
            w.grows += 1
        w.changed_at, w.full, w.starved = now, False, False

    def shrink(self, worker: WorkerId) -> None:
        """Halve worker's window (its TTFT passed a target, or its engine refused for a full queue)."""
        w = self._get(worker)
        now = self._clock()
        if now - w.changed_at < ADJUST_EVERY_SECONDS and w.shrinks:
            return
        w.limit = max(float(self._min), w.limit / 2)
        w.shrinks += 1
        w.changed_at, w.full, w.starved = now, False, False

    def forget(self, keep: Iterable[WorkerId]) -> None:
        """Drop the windows of workers that left (keeping any with requests still in flight)."""
        keep = set(keep)
        for worker in [w for w, win in self._windows.items() if w not in keep and not win.in_flight]:
            del self._windows[worker]

    def state(self) -> dict[WorkerId, Window]:
        return dict(self._windows)

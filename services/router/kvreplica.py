"""The router's read replica of the KV directory, so that a placement looks its prompt's blocks up
in this process's memory instead of calling the kvcache service (how llm-d's endpoint picker holds
its prefix index). The kvcache service stays the owner: it watches the workers' KV events, and
streams what it holds and then each change to every router that follows it
(gaas.v1.KVCache.Follow; services/kvcache/follow.py).

Memory: each distinct block held anywhere costs one dict entry (its hash, and a bit mask of the
workers holding it): about 100 bytes, so 100k blocks across the fleet cost ~10 MB. Provisioned
blocks (a router's recent placement, until its engine confirms them or a TTL passes) cost about as
much again while they last. Bounded by what the engines' caches hold.

Follow: a broken stream (kvcache restarting, or this router cut off for falling behind) is
followed again, and the snapshot that begins every stream replaces what the replica held. Until the
first one arrives the replica cannot answer (the caller falls back on its recent placements);
while a stream is down it answers from what it last knew.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gaas.contracts.ids import WorkerId
from gaas.v1 import kvcache_pb2 as pb

log = logging.getLogger(__name__)

STORED, REMOVED, CLEARED, PROVISIONED, LEFT = (
    pb.BlockChange.STORED, pb.BlockChange.REMOVED, pb.BlockChange.CLEARED, pb.BlockChange.PROVISIONED,
    pb.BlockChange.LEFT)
# The kvcache service's default, until its first message says.
PROVISION_TTL_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A prompt's blocks as the directory knows them: the leading blocks each worker holds
    (confirmed by its engine, or provisioned by a recent placement), and of those, the confirmed."""

    matched: Mapping[WorkerId, int] = field(default_factory=dict)
    confirmed: Mapping[WorkerId, int] = field(default_factory=dict)


NO_MATCH = PrefixMatch()


class Replica:
    """Which workers hold which blocks (GaaS's chained hashes), as bit masks of the workers."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # Worker -> its bit, and each bit's worker (None: free).
        self._bit: dict[WorkerId, int] = {}
        self._worker_of: list[WorkerId | None] = []
        # Hash -> workers whose engines hold it; hash -> workers it is provisioned on.
        self._held: dict[int, int] = {}
        self._provisional: dict[int, int] = {}
        # (expiry, hash, bit) of each provision, soonest first (one TTL for all); and the latest
        # expiry of each (hash, bit) (a renewal outlives the first).
        self._expiries: deque[tuple[float, int, int]] = deque()
        self._expires: dict[tuple[int, int], float] = {}
        self.ttl = PROVISION_TTL_SECONDS
        # Whether it has had a snapshot (it can answer).
        self.synced = False
        self.snapshots = 0

    @property
    def blocks(self) -> int:
        return len(self._held)

    def _bit_of(self, worker: WorkerId) -> int:
        bit = self._bit.get(worker)
        if bit is None:
            free = next((i for i, w in enumerate(self._worker_of) if w is None), None)
            if free is None:
                free = len(self._worker_of)
                self._worker_of.append(None)
            self._worker_of[free] = worker
            bit = self._bit[worker] = free
        return bit

    # ------------------------------------------------------------ changes

    def apply(self, msg: pb.DirectoryChanges) -> None:
        """One message of the directory's stream (a snapshot's first replaces everything)."""
        if msg.snapshot:
            self._held.clear()
            self._provisional.clear()
            self._expiries.clear()
            self._expires.clear()
            self._bit.clear()
            self._worker_of.clear()
            self.synced = True
            self.snapshots += 1
        if msg.provision_ttl_seconds:
            self.ttl = msg.provision_ttl_seconds
        for change in msg.changes:
            worker = WorkerId(change.worker_id)
            if change.kind == STORED:
                self.stored(worker, change.hashes)
            elif change.kind == REMOVED:
                self.removed(worker, change.hashes)
            elif change.kind == CLEARED:
                self.cleared(worker)
            elif change.kind == PROVISIONED:
                self.provision(worker, change.hashes)
            elif change.kind == LEFT:
                self.left(worker)

    def stored(self, worker: WorkerId, hashes: Sequence[int]) -> None:
        mask = 1 << self._bit_of(worker)
        held, provisional = self._held, self._provisional
        for h in hashes:
            held[h] = held.get(h, 0) | mask
            if (p := provisional.get(h)) is not None and p & mask:
                p &= ~mask
                if p:
                    provisional[h] = p
                else:
                    del provisional[h]

    def removed(self, worker: WorkerId, hashes: Sequence[int]) -> None:
        bit = self._bit.get(worker)
        if bit is None:
            return
        mask, held = 1 << bit, self._held
        for h in hashes:
            if (m := held.get(h)) is not None:
                m &= ~mask
                if m:
                    held[h] = m
                else:
                    del held[h]

    def cleared(self, worker: WorkerId) -> None:
        """The worker's engine holds nothing any more (what is provisioned on it lasts its TTL)."""
        bit = self._bit.get(worker)
        if bit is None:
            return
        mask, held = 1 << bit, self._held
        for h in [h for h, m in held.items() if m & mask]:
            m = held[h] & ~mask
            if m:
                held[h] = m
            else:
                del held[h]
        if not any(m & mask for m in self._provisional.values()):
            del self._bit[worker]
            self._worker_of[bit] = None

    def left(self, worker: WorkerId) -> None:
        """The worker left the mesh: nothing counts for it any more, and its bit is free."""
        bit = self._bit.get(worker)
        if bit is None:
            return
        self.cleared(worker)
        mask, provisional = 1 << bit, self._provisional
        for h in [h for h, m in provisional.items() if m & mask]:
            m = provisional[h] & ~mask
            if m:
                provisional[h] = m
            else:
                del provisional[h]
        self._expires = {k: t for k, t in self._expires.items() if k[1] != bit}
        self._bit.pop(worker, None)
        self._worker_of[bit] = None

    def provision(self, worker: WorkerId, hashes: Sequence[int]) -> None:
        """A request with these blocks went to worker: they count there for the TTL, unless its
        engine confirms them first."""
        bit = self._bit_of(worker)
        mask, held, provisional = 1 << bit, self._held, self._provisional
        expires = self._clock() + self.ttl
        for h in hashes:
            if held.get(h, 0) & mask:
                continue
            provisional[h] = provisional.get(h, 0) | mask
            self._expires[(h, bit)] = expires
            self._expiries.append((expires, h, bit))

    def expire(self) -> None:
        now, expiries, provisional = self._clock(), self._expiries, self._provisional
        while expiries and expiries[0][0] <= now:
            t, h, bit = expiries.popleft()
            if self._expires.get((h, bit)) != t:
                continue  # renewed since
            del self._expires[(h, bit)]
            if (p := provisional.get(h)) is not None:
                p &= ~(1 << bit)
                if p:
                    provisional[h] = p
                else:
                    del provisional[h]

    # ------------------------------------------------------------ lookups

    def lookup(self, hashes: Sequence[int]) -> PrefixMatch:
        """What each worker holds of hashes' leading blocks, as the directory's own lookup counts
        them."""
        self.expire()
        held, provisional = self._held, self._provisional
        matched: dict[WorkerId, int] = {}
        confirmed: dict[WorkerId, int] = {}
        active = run = -1  # every worker, until the first block says
        depth = 0
        for h in hashes:
            c = held.get(h, 0)
            a = active & (c | provisional.get(h, 0))
            r = run & c
            if depth:
                self._note(active & ~a, depth, matched)
                self._note(run & ~r, depth, confirmed)
            active, run = a, r
            if not a:
                break
            depth += 1
        else:
            if depth:
                self._note(active, depth, matched)
                self._note(run, depth, confirmed)
        return PrefixMatch(matched, confirmed)

    def _note(self, mask: int, depth: int, out: dict[WorkerId, int]) -> None:
        workers = self._worker_of
        while mask:
            low = mask & -mask
            worker = workers[low.bit_length() - 1]
            if worker is not None:
                out[worker] = depth
            mask ^= low


class Follower:
    """Keeps a Replica in step with the kvcache service's stream, until cancelled."""

    def __init__(self, replica: Replica, follow: Callable[[], object], retry_seconds: float = 1.0,
                 staleness=None) -> None:
        self._replica = replica
        # () -> the stream of DirectoryChanges (a new call each time it is followed again).
        self._follow = follow
        self._retry = retry_seconds
        # A histogram's observe (seconds from an engine's event to its change applied here).
        self._staleness = staleness
        self.messages = 0

    async def run(self) -> None:
        failing = False
        while True:
            try:
                async for msg in self._follow():
                    self._replica.apply(msg)
                    self.messages += 1
                    if msg.oldest_event_unix and self._staleness is not None:
                        self._staleness(max(0.0, time.time() - msg.oldest_event_unix))
                    if failing:
                        log.info("following the KV directory again (%d blocks)", self._replica.blocks)
                        failing = False
                log.info("the KV directory ended its stream; following it again")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - kvcache restarting or unreachable: follow again
                if not failing:
                    detail = f"{exc.code().name}: {exc.details()}" if hasattr(exc, "code") else repr(exc)
                    log.warning("cannot follow the KV directory (%s); placing on what this router last knew of it "
                                "meanwhile", detail)
                failing = True
            await asyncio.sleep(self._retry)

"""The KV page directory: which worker holds which prefix blocks, rebuilt from the workers' KV
events (so any replica can rebuild it). Pure data structure, no I/O.

Blocks are keyed by GaaS's own chained hashes (gaas/contracts/kvhash.py), computed here from the token ids
the engines report, the cache salt and the LoRA adapter: the engines' hashes are only used to
match their later removals to what they stored. A lookup counts, per worker, the leading blocks of
a prompt it holds: confirmed by its engine, or provisioned by a router that just sent it a request
(so a burst sharing a new prefix lands together before the engine has reported anything).
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gaas.contracts import kvhash
from gaas.contracts.ids import WorkerId
from gaas.contracts.kvhash import BlockHash
from services.kvcache.follow import CLEARED, LEFT, PROVISIONED, REMOVED, STORED, Feed, snapshot_messages

log = logging.getLogger(__name__)

UNKNOWN_TENANT = ""


@dataclass(frozen=True, slots=True)
class Stored:
    """One BlockStored event, as the engine reported it."""

    # The engine's hashes of the blocks, and of the block before the first (None: a first block).
    engine_hashes: Sequence[int]
    parent: int | None
    token_ids: Sequence[int]
    block_size: int
    cache_salt: str = ""
    lora_name: str = ""


@dataclass(frozen=True, slots=True)
class Match:
    worker_id: WorkerId
    # Leading blocks of the lookup this worker holds, confirmed or provisioned.
    matched_blocks: int
    # Of those, the ones its engine confirmed.
    confirmed_blocks: int


@dataclass(slots=True)
class _Worker:
    # engine hash -> GaaS hash of the blocks it holds.
    by_engine: dict[int, BlockHash] = field(default_factory=dict)
    # GaaS hash -> how many of its engine's blocks stand for it (normally one).
    blocks: dict[BlockHash, int] = field(default_factory=dict)
    # Provisioned blocks: GaaS hash -> expiry (monotonic seconds).
    provisional: dict[BlockHash, float] = field(default_factory=dict)
    epoch: int = 0
    # The sequence number the worker's next batch must carry.
    next_seq: int = 0


@dataclass(frozen=True, slots=True)
class WorkerStats:
    worker_id: WorkerId
    blocks: int
    unreachable_blocks: int
    provisional_blocks: int
    epoch: int
    last_seq: int


@dataclass(frozen=True, slots=True)
class Stats:
    block_size: int | None
    workers: int
    blocks: int
    events: int
    per_worker: list[WorkerStats]
    per_tenant: dict[str, int]
    lookups: int
    lookup_blocks: int
    hit_blocks: int
    hit_ratio: float
    fragmentation: float
    provisioned: int
    provision_confirmed: int
    provision_expired: int
    unchained_blocks: int
    wrong_size_blocks: int
    resyncs: int
    sequence_gaps: int


class BlockDirectory:
    def __init__(
        self,
        block_size: int | None = None,
        provision_ttl_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self._ttl = provision_ttl_seconds
        self._clock = clock
        self._workers: dict[WorkerId, _Worker] = {}
        # GaaS hash -> workers whose engine holds it.
        self._holders: dict[BlockHash, set[WorkerId]] = defaultdict(set)
        # GaaS hash -> workers it is provisioned on.
        self._provisioned: dict[BlockHash, set[WorkerId]] = defaultdict(set)
        # GaaS hash -> its parent's (None for a first block) and its chain's first block: what
        # reachability and the per-tenant figures are computed from.
        self._parent: dict[BlockHash, BlockHash | None] = {}
        self._first: dict[BlockHash, BlockHash] = {}
        # First-block hash -> tenant, learned from the routers' provisions.
        self._tenant_of_first: dict[BlockHash, str] = {}
        # (expiry, worker, hash) of every provision, soonest first.
        self._expiries: list[tuple[float, WorkerId, BlockHash]] = []
        self.events = 0
        self.lookups = self.lookup_blocks = self.hit_blocks = 0
        self.provisioned = self.provision_confirmed = self.provision_expired = 0
        self.unchained_blocks = self.wrong_size_blocks = 0
        self.resyncs = self.sequence_gaps = 0
        # Every change, for the routers' read replicas (follow.py).
        self.feed = Feed(provision_ttl_seconds)

    # ------------------------------------------------------------ events

    def _worker(self, worker: WorkerId) -> _Worker:
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _Worker()
        return w

    def stored(self, worker: WorkerId, ev: Stored, block_size: int | None = None) -> int:
        """Index a BlockStored event (block_size: what the worker registered with, when known);
        returns the blocks indexed."""
        w = self._worker(worker)
        expected = block_size or self.block_size
        if expected and ev.block_size != expected:
            self.wrong_size_blocks += len(ev.engine_hashes)
            log.error("%s's engine stores blocks of %d tokens, but it registered blocks of %d: not indexed",
                      worker, ev.block_size, expected)
            return 0
        if len(ev.token_ids) != len(ev.engine_hashes) * ev.block_size:
            self.unchained_blocks += len(ev.engine_hashes)
            return 0
        if ev.parent is None:
            parent: BlockHash | None = None
            chain_parent = kvhash.root(ev.cache_salt, ev.lora_name)
        else:
            parent = w.by_engine.get(ev.parent)
            if parent is None:
                # Its parent was never reported (or is gone): the chain cannot be followed.
                self.unchained_blocks += len(ev.engine_hashes)
                return 0
            chain_parent = parent
        hashes = kvhash.chain(chain_parent, ev.token_ids, ev.block_size)
        by_engine, blocks, holders, parents, firsts = w.by_engine, w.blocks, self._holders, self._parent, self._first
        first = firsts.get(parent, parent) if parent is not None else hashes[0] if hashes else None
        held = []
        for engine_hash, h in zip(ev.engine_hashes, hashes):
            if by_engine.get(engine_hash) == h:
                parent = h
                continue  # already known (a snapshot repeating a live event)
            by_engine[engine_hash] = h
            blocks[h] = blocks.get(h, 0) + 1
            holders[h].add(worker)
            held.append(h)
            parents[h] = parent
            firsts[h] = first
            if w.provisional and w.provisional.pop(h, None) is not None:
                self.provision_confirmed += 1
                self._unprovision(h, worker)
            parent = h
        if held:
            self.feed.record(STORED, worker, held)
        return len(hashes)

    def removed(self, worker: WorkerId, engine_hashes: Sequence[int]) -> None:
        w = self._workers.get(worker)
        if w is None:
            return
        gone = []
        for engine_hash in engine_hashes:
            h = w.by_engine.pop(engine_hash, None)
            if h is None:
                continue
            standing = w.blocks.get(h, 0) - 1
            if standing > 0:
                w.blocks[h] = standing
            else:
                w.blocks.pop(h, None)
                self._release(h, worker)
                gone.append(h)
        if gone:
            self.feed.record(REMOVED, worker, gone)

    def cleared(self, worker: WorkerId) -> None:
        """The worker's engine dropped every block (or the worker is gone)."""
        w = self._workers.get(worker)
        if w is None:
            return
        for h in list(w.blocks):
            self._release(h, worker)
        w.blocks.clear()
        w.by_engine.clear()
        self.feed.record(CLEARED, worker)

    def drop_worker(self, worker: WorkerId) -> None:
        """Forget a worker entirely (its lease ended)."""
        self.cleared(worker)
        w = self._workers.pop(worker, None)
        if w is not None:
            for h in w.provisional:
                self._unprovision(h, worker)
        self.feed.record(LEFT, worker)

    def resync(self, worker: WorkerId, epoch: int, next_seq: int) -> None:
        """A snapshot follows: what the worker held before is replaced; its live batches then
        continue at next_seq."""
        w = self._worker(worker)
        if w.epoch:
            self.resyncs += 1
        self.cleared(worker)
        w.epoch, w.next_seq = epoch, next_seq

    def note_seq(self, worker: WorkerId, epoch: int, seq: int) -> bool:
        """Record a live batch's place; False when it does not follow the last (a gap: resync)."""
        w = self._worker(worker)
        if epoch != w.epoch or seq != w.next_seq:
            self.sequence_gaps += 1
            return False
        w.next_seq = seq + 1
        self.events += 1
        return True

    def _release(self, h: BlockHash, worker: WorkerId) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[h]
                if h not in self._provisioned:
                    self._forget(h)

    def _forget(self, h: BlockHash) -> None:
        self._parent.pop(h, None)
        self._first.pop(h, None)
        self._tenant_of_first.pop(h, None)

    # ------------------------------------------------------------ routers

    def provision(self, worker: WorkerId, hashes: Sequence[int], tenant: str = UNKNOWN_TENANT) -> None:
        """A router sent a request with these blocks to worker: count them there for a while."""
        if not hashes:
            return
        w = self._worker(worker)
        expires = self._clock() + self._ttl
        first = BlockHash(hashes[0])
        if tenant:
            self._tenant_of_first[first] = tenant
        parent: BlockHash | None = None
        fresh = []
        for raw in hashes:
            h = BlockHash(raw)
            if h not in w.blocks:
                if h not in w.provisional:
                    self.provisioned += 1
                w.provisional[h] = expires
                heapq.heappush(self._expiries, (expires, worker, h))
                self._provisioned[h].add(worker)
                self._parent.setdefault(h, parent)
                self._first.setdefault(h, first)
                fresh.append(h)
            parent = h
        if fresh:
            self.feed.record(PROVISIONED, worker, fresh)

    def looked_up(self, blocks: int, best_matched: int) -> None:
        """A router's replica answered a lookup of blocks, the best worker holding best_matched
        (the hit figures, as lookup() counts its own)."""
        self.lookups += 1
        self.lookup_blocks += blocks
        self.hit_blocks += min(best_matched, blocks)

    def snapshot(self):
        """Everything held now, as the first messages of a follower's stream (follow.py)."""
        self.expire()
        return snapshot_messages({wid: list(w.blocks) for wid, w in self._workers.items() if w.blocks},
                                 {wid: list(w.provisional) for wid, w in self._workers.items() if w.provisional},
                                 self._ttl)

    def _unprovision(self, h: BlockHash, worker: WorkerId) -> None:
        workers = self._provisioned.get(h)
        if workers is not None:
            workers.discard(worker)
            if not workers:
                del self._provisioned[h]
                if h not in self._holders:
                    self._forget(h)

    def expire(self) -> None:
        """Drop provisions their engines never confirmed."""
        now = self._clock()
        while self._expiries and self._expiries[0][0] <= now:
            t, worker, h = heapq.heappop(self._expiries)
            w = self._workers.get(worker)
            if w is not None and w.provisional.get(h) == t:  # not confirmed or renewed since
                del w.provisional[h]
                self.provision_expired += 1
                self._unprovision(h, worker)

    def lookup(self, hashes: Sequence[int]) -> list[Match]:
        """Workers holding a prefix of hashes, longest first (ties by worker id)."""
        self.expire()
        self.lookups += 1
        self.lookup_blocks += len(hashes)
        matched: dict[WorkerId, list[int]] = {}
        active: set[WorkerId] | None = None
        for depth, raw in enumerate(hashes):
            h = BlockHash(raw)
            confirmed = self._holders.get(h, set())
            here = confirmed | self._provisioned.get(h, set())
            active = set(here) if active is None else active & here
            if not active:
                break
            for worker in active:
                counts = matched.setdefault(worker, [0, 0])
                counts[0] = depth + 1
                if worker in confirmed and counts[1] == depth:
                    counts[1] = depth + 1
        out = sorted((Match(w, n, c) for w, (n, c) in matched.items()), key=lambda m: (-m.matched_blocks, m.worker_id))
        if out:
            self.hit_blocks += out[0].matched_blocks
        return out

    # ------------------------------------------------------------ figures

    def stats(self) -> Stats:
        self.expire()
        per_worker = []
        per_tenant: dict[str, int] = defaultdict(int)
        unreachable_total = 0
        for worker, w in sorted(self._workers.items()):
            unreachable = 0
            for h in w.blocks:
                parent = self._parent.get(h)
                if parent is not None and parent not in w.blocks:
                    unreachable += 1
                per_tenant[self._tenant_of_first.get(self._first.get(h, h), UNKNOWN_TENANT)] += 1
            unreachable_total += unreachable
            per_worker.append(WorkerStats(worker, len(w.blocks), unreachable, len(w.provisional), w.epoch, w.next_seq - 1))
        indexed = sum(s.blocks for s in per_worker)
        return Stats(
            block_size=self.block_size,
            workers=sum(1 for s in per_worker if s.blocks),
            blocks=len(self._holders),
            events=self.events,
            per_worker=per_worker,
            per_tenant=dict(per_tenant),
            lookups=self.lookups,
            lookup_blocks=self.lookup_blocks,
            hit_blocks=self.hit_blocks,
            hit_ratio=self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0,
            fragmentation=unreachable_total / indexed if indexed else 0.0,
            provisioned=self.provisioned,
            provision_confirmed=self.provision_confirmed,
            provision_expired=self.provision_expired,
            unchained_blocks=self.unchained_blocks,
            wrong_size_blocks=self.wrong_size_blocks,
            resyncs=self.resyncs,
            sequence_gaps=self.sequence_gaps,
        )

    def holds(self, worker: WorkerId) -> set[BlockHash]:
        """The blocks the worker's engine holds (for tests and snapshots)."""
        w = self._workers.get(worker)
        return set(w.blocks) if w else set()

"""The KV page directory: which worker holds which prefix blocks, rebuilt from the workers' KV
events (so any replica can rebuild it). Pure data structure, no I/O."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

WorkerId = NewType("WorkerId", str)
BlockHash = NewType("BlockHash", int)


@dataclass(frozen=True, slots=True)
class Match:
    worker_id: WorkerId
    # Leading blocks of the lookup this worker holds.
    matched_blocks: int


class BlockDirectory:
    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[WorkerId]] = defaultdict(set)
        self._by_worker: dict[WorkerId, set[BlockHash]] = defaultdict(set)
        # Events applied, for stats.
        self.events = 0

    def stored(self, worker: WorkerId, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._holders[BlockHash(h)].add(worker)
            self._by_worker[worker].add(BlockHash(h))
        self.events += 1

    def removed(self, worker: WorkerId, hashes: Iterable[int]) -> None:
        for h in hashes:
            holders = self._holders.get(BlockHash(h))
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[BlockHash(h)]
            self._by_worker[worker].discard(BlockHash(h))
        self.events += 1

    def cleared(self, worker: WorkerId) -> None:
        self.removed(worker, list(self._by_worker.pop(worker, ())))

    def lookup(self, hashes: Sequence[int]) -> list[Match]:
        """Workers holding a prefix of hashes, longest first (ties by worker id)."""
        if not hashes:
            return []
        active = set(self._holders.get(BlockHash(hashes[0]), ()))
        matched: dict[WorkerId, int] = {}
        depth = 0
        for depth, h in enumerate(hashes):
            still = active & self._holders.get(BlockHash(h), set())
            for w in active - still:
                matched[w] = depth
            active = still
            if not active:
                break
        else:
            depth = len(hashes)
        for w in active:
            matched[w] = depth
        return sorted((Match(w, n) for w, n in matched.items() if n > 0), key=lambda m: (-m.matched_blocks, m.worker_id))

    @property
    def workers(self) -> int:
        return sum(1 for blocks in self._by_worker.values() if blocks)

    @property
    def blocks(self) -> int:
        return len(self._holders)

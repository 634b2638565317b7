"""The router's view of the KV directory: the prefix lookup made before scheduling, answered from
this router's read replica of the directory (kvreplica.py: no remote call), and the provision
made after it, filed in the replica at once and sent to the kvcache service without waiting. Until
the replica has had its first snapshot (kvcache not reachable yet), requests are scheduled on this
router's own memory of where it recently sent which blocks (what the SGLang router keeps as its
approximate tree), and the logs say so, rather than failed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import grpc

from gaas.v1 import kvcache_pb2, kvcache_pb2_grpc
from gaas.contracts.ids import WorkerId
from services.router.kvreplica import NO_MATCH, PrefixMatch, Replica

log = logging.getLogger(__name__)

# Blocks whose placement a router remembers (~100 bytes each).
RECENT_BLOCKS = 65536


class RecentPlacements:
    """Where this router last sent each block (by hash), the most recent RECENT_BLOCKS of them."""

    def __init__(self, capacity: int = RECENT_BLOCKS) -> None:
        self._where: OrderedDict[int, WorkerId] = OrderedDict()
        self._capacity = capacity

    def placed(self, worker: WorkerId, hashes: Sequence[int]) -> None:
        where = self._where
        for h in hashes:
            where[h] = worker
            where.move_to_end(h)
        while len(where) > self._capacity:
            where.popitem(last=False)

    def leading(self, hashes: Sequence[int]) -> dict[WorkerId, int]:
        """The worker this router sent the prompt's first block to, with how many leading blocks
        in a row it sent there."""
        if not hashes or (worker := self._where.get(hashes[0])) is None:
            return {}
        n = 0
        for h in hashes:
            if self._where.get(h) != worker:
                break
            n += 1
        return {worker: n}


class KVDirectoryClient:
    def __init__(self, stub: kvcache_pb2_grpc.KVCacheStub, replica: Replica | None = None) -> None:
        self._stub = stub
        self.replica = replica or Replica()
        self._tasks: set[asyncio.Task] = set()
        self._warned_at = 0.0
        self.recent = RecentPlacements()
        # Lookups the replica could not answer (answered from self.recent).
        self.unanswered = 0

    def _warn(self, what: str, exc: grpc.aio.AioRpcError) -> None:
        now = time.monotonic()
        if now - self._warned_at > 30:
            self._warned_at = now
            log.warning("the KV directory %s (%s: %s)", what, exc.code().name, exc.details())

    def follow(self):
        """The kvcache service's stream of what it holds and each change (kvreplica.Follower)."""
        return self._stub.Follow(kvcache_pb2.FollowRequest())

    def lookup(self, hashes: Sequence[int]) -> PrefixMatch:
        """What each worker holds of the prompt's leading blocks; before the replica's first
        snapshot, where this router recently sent them (none confirmed)."""
        if not hashes:
            return NO_MATCH
        if not self.replica.synced:
            self.unanswered += 1
            return PrefixMatch(self.recent.leading(hashes))
        return self.replica.lookup(hashes)

    def provision(self, worker: WorkerId, hashes: Sequence[int], tenant: str, best_matched: int = 0) -> None:
        """File these blocks under worker here (the replica, and the recent placements), and tell
        the directory without waiting (with the lookup's best match, for its hit figures)."""
        if not hashes:
            return
        self.recent.placed(worker, hashes)
        self.replica.provision(worker, hashes)

        async def send() -> None:
            try:
                await self._stub.Provision(
                    kvcache_pb2.ProvisionRequest(worker_id=worker, block_hashes=hashes, tenant=tenant,
                                                 best_matched_blocks=best_matched), timeout=1.0
                )
            except grpc.aio.AioRpcError as exc:
                self._warn("refused a provision", exc)

        task = asyncio.create_task(send())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)

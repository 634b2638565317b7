"""The router's view of the KV directory: the prefix lookup made before scheduling, and the
provision made after it, as plain callables over the kvcache service. The directory is an
optimisation: when it does not answer in time (a busy host, kvcache restarting), requests are
scheduled on this router's own memory of where it recently sent which blocks (what the SGLang
router keeps as its approximate tree), and the logs say so, rather than failed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import grpc

from gaas.v1 import kvcache_pb2, kvcache_pb2_grpc
from gaas.contracts.ids import WorkerId

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
    def __init__(self, stub: kvcache_pb2_grpc.KVCacheStub, timeout_seconds: float = 0.05) -> None:
        self._stub = stub
        self._timeout = timeout_seconds
        self._tasks: set[asyncio.Task] = set()
        self._warned_at = 0.0
        self.recent = RecentPlacements()
        # Lookups the directory did not answer in time (answered from self.recent).
        self.unanswered = 0

    def _warn(self, what: str, exc: grpc.aio.AioRpcError) -> None:
        now = time.monotonic()
        if now - self._warned_at > 30:
            self._warned_at = now
            log.warning("the KV directory %s (%s: %s); routing on this router's own recent placements meanwhile",
                        what, exc.code().name, exc.details())

    async def lookup(self, hashes: Sequence[int]) -> tuple[dict[WorkerId, int], dict[WorkerId, int]]:
        """(leading blocks each worker holds, of which its engine confirmed); when the directory
        does not answer in time, where this router recently sent the leading blocks (none
        confirmed)."""
        if not hashes:
            return {}, {}
        try:
            resp = await self._stub.Lookup(kvcache_pb2.LookupRequest(block_hashes=hashes), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            self._warn("did not answer a lookup", exc)
            self.unanswered += 1
            return self.recent.leading(hashes), {}
        matched = {WorkerId(m.worker_id): m.matched_blocks for m in resp.matches}
        confirmed = {WorkerId(m.worker_id): m.confirmed_blocks for m in resp.matches}
        return matched, confirmed

    def provision(self, worker: WorkerId, hashes: Sequence[int], tenant: str) -> None:
        """Tell the directory, without waiting, that worker will hold these blocks (and remember
        it here)."""
        if not hashes:
            return
        self.recent.placed(worker, hashes)

        async def send() -> None:
            try:
                await self._stub.Provision(
                    kvcache_pb2.ProvisionRequest(worker_id=worker, block_hashes=hashes, tenant=tenant), timeout=1.0
                )
            except grpc.aio.AioRpcError as exc:
                self._warn("refused a provision", exc)

        task = asyncio.create_task(send())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)

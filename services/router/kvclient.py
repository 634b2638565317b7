"""The router's view of the KV directory: the prefix lookup made before scheduling, and the
provision made after it, as plain callables over the kvcache service. The directory is an
optimisation: when it does not answer in time, requests are scheduled without prefix knowledge
(and the logs say so) rather than failed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import grpc

from gaas.v1 import kvcache_pb2, kvcache_pb2_grpc
from services.router.scheduling.types import WorkerId

log = logging.getLogger(__name__)


class KVDirectoryClient:
    def __init__(self, stub: kvcache_pb2_grpc.KVCacheStub, timeout_seconds: float = 0.05) -> None:
        self._stub = stub
        self._timeout = timeout_seconds
        self._tasks: set[asyncio.Task] = set()
        self._warned_at = 0.0

    def _warn(self, what: str, exc: grpc.aio.AioRpcError) -> None:
        now = time.monotonic()
        if now - self._warned_at > 30:
            self._warned_at = now
            log.warning("the KV directory %s (%s: %s); routing without prefix knowledge meanwhile",
                        what, exc.code().name, exc.details())

    async def lookup(self, hashes: Sequence[int]) -> tuple[dict[WorkerId, int], dict[WorkerId, int]]:
        """(leading blocks each worker holds, of which its engine confirmed); empty when the
        directory does not answer in time."""
        if not hashes:
            return {}, {}
        try:
            resp = await self._stub.Lookup(kvcache_pb2.LookupRequest(block_hashes=hashes), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            self._warn("did not answer a lookup", exc)
            return {}, {}
        matched = {WorkerId(m.worker_id): m.matched_blocks for m in resp.matches}
        confirmed = {WorkerId(m.worker_id): m.confirmed_blocks for m in resp.matches}
        return matched, confirmed

    def provision(self, worker: WorkerId, hashes: Sequence[int], tenant: str) -> None:
        """Tell the directory, without waiting, that worker will hold these blocks."""
        if not hashes:
            return

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

"""gaas.v1.KVCache: protobuf <-> BlockDirectory."""

from __future__ import annotations

import logging

from gaas import errors
from gaas.v1 import kvcache_pb2 as pb
from gaas.v1 import kvcache_pb2_grpc
from services.kvcache.directory import BlockDirectory, WorkerId

log = logging.getLogger(__name__)


class KVCacheServicer(kvcache_pb2_grpc.KVCacheServicer):
    def __init__(self, directory: BlockDirectory) -> None:
        self._dir = directory
        # Last sequence number applied per worker: batches at or below it are duplicates.
        self._last_seq: dict[str, int] = {}

    async def PublishEvents(self, request_iterator, context) -> pb.PublishEventsResponse:
        last = 0
        async for batch in request_iterator:
            if not batch.worker_id:
                raise errors.InvalidArgument("worker_id is required on every batch")
            worker = WorkerId(batch.worker_id)
            if batch.seq and batch.seq <= self._last_seq.get(worker, 0):
                continue  # a re-sent batch
            for ev in batch.events:
                kind = ev.WhichOneof("event")
                if kind == "stored":
                    self._dir.stored(worker, ev.stored.block_hashes)
                elif kind == "removed":
                    self._dir.removed(worker, ev.removed.block_hashes)
                elif kind == "cleared":
                    self._dir.cleared(worker)
            self._last_seq[worker] = last = batch.seq
        return pb.PublishEventsResponse(last_seq=last)

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        matches = self._dir.lookup(list(request.block_hashes))
        return pb.LookupResponse(
            matches=[pb.WorkerMatch(worker_id=m.worker_id, matched_blocks=m.matched_blocks) for m in matches]
        )

    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.DirectoryStats:
        return pb.DirectoryStats(workers=self._dir.workers, blocks=self._dir.blocks, events=self._dir.events)

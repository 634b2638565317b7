"""gaas.v1.KVCache: protobuf <-> BlockDirectory, and its change feed to the routers' replicas."""

from __future__ import annotations

from gaas.contracts import errors
from gaas.v1 import kvcache_pb2 as pb
from gaas.v1 import kvcache_pb2_grpc
from gaas.contracts.ids import WorkerId
from services.kvcache.directory import BlockDirectory

# Longest lookup accepted: a 1M-token prompt in blocks of 16.
MAX_BLOCKS = 1 << 16


def stats_pb(d: BlockDirectory) -> pb.DirectoryStats:
    s = d.stats()
    return pb.DirectoryStats(
        workers=s.workers,
        blocks=s.blocks,
        events=s.events,
        per_worker=[
            pb.WorkerBlocks(
                worker_id=w.worker_id, blocks=w.blocks, unreachable_blocks=w.unreachable_blocks,
                provisional_blocks=w.provisional_blocks, epoch=w.epoch, last_seq=max(w.last_seq, 0),
            )
            for w in s.per_worker
        ],
        per_tenant=[pb.TenantBlocks(tenant=t, blocks=n) for t, n in sorted(s.per_tenant.items())],
        lookups=s.lookups,
        lookup_blocks=s.lookup_blocks,
        hit_blocks=s.hit_blocks,
        hit_ratio=s.hit_ratio,
        fragmentation=s.fragmentation,
        provisioned=s.provisioned,
        provision_confirmed=s.provision_confirmed,
        provision_expired=s.provision_expired,
        unchained_blocks=s.unchained_blocks,
        wrong_size_blocks=s.wrong_size_blocks,
        block_size=s.block_size or 0,
        resyncs=s.resyncs,
        sequence_gaps=s.sequence_gaps,
    )


class KVCacheServicer(kvcache_pb2_grpc.KVCacheServicer):
    def __init__(self, directory: BlockDirectory) -> None:
        self._dir = directory

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        if len(request.block_hashes) > MAX_BLOCKS:
            raise errors.InvalidArgument(f"at most {MAX_BLOCKS} block hashes per lookup", param="block_hashes")
        matches = self._dir.lookup(request.block_hashes)
        return pb.LookupResponse(
            matches=[
                pb.WorkerMatch(worker_id=m.worker_id, matched_blocks=m.matched_blocks, confirmed_blocks=m.confirmed_blocks)
                for m in matches
            ]
        )

    async def Provision(self, request: pb.ProvisionRequest, context) -> pb.ProvisionResponse:
        if not request.worker_id:
            raise errors.InvalidArgument("worker_id is required", param="worker_id")
        if len(request.block_hashes) > MAX_BLOCKS:
            raise errors.InvalidArgument(f"at most {MAX_BLOCKS} block hashes per provision", param="block_hashes")
        self._dir.provision(WorkerId(request.worker_id), request.block_hashes, request.tenant)
        if request.best_matched_blocks:
            self._dir.looked_up(len(request.block_hashes), request.best_matched_blocks)
        return pb.ProvisionResponse()

    async def Follow(self, request: pb.FollowRequest, context):
        """What the directory holds, then each change (follow.py): a router's read replica."""
        async for msg in self._dir.feed.follow(self._dir.snapshot()):
            yield msg

    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.DirectoryStats:
        return stats_pb(self._dir)

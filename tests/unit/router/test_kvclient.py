"""The router's KV directory client: when the directory does not answer in time, a prompt is still
routed where this router last sent its blocks."""

import grpc

from services.router.kvclient import KVDirectoryClient, RecentPlacements
from services.router.scheduling import WorkerId


class SilentDirectory:
    def __init__(self):
        self.provisions = []

    async def Lookup(self, request, timeout=None):
        raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), "slow")

    async def Provision(self, request, timeout=None):
        self.provisions.append(request)


async def test_a_lookup_the_directory_does_not_answer_falls_back_on_the_routers_recent_placements():
    kv = KVDirectoryClient(SilentDirectory(), timeout_seconds=0.01)
    assert await kv.lookup([1, 2, 3]) == ({}, {}), "nothing placed yet: no prefix knowledge"
    kv.provision(WorkerId("w1"), [1, 2, 3], "acme")
    assert await kv.lookup([1, 2, 3, 4]) == ({"w1": 3}, {}), "three leading blocks sent to w1, none confirmed"
    assert await kv.lookup([9, 2, 3]) == ({}, {}), "a different first block is a different prefix"
    kv.provision(WorkerId("w0"), [1, 2], "acme")
    assert await kv.lookup([1, 2, 3]) == ({"w0": 2}, {}), "the latest placement wins"
    assert kv.unanswered == 4
    await kv.close()


def test_recent_placements_are_bounded():
    r = RecentPlacements(capacity=4)
    r.placed(WorkerId("w0"), [1, 2, 3])
    r.placed(WorkerId("w1"), [7, 8, 9])
    assert r.leading([1, 2, 3]) == {} and r.leading([7, 8, 9]) == {"w1": 3}

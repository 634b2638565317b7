"""The router's KV directory client: lookups answered from its replica once it has had the
directory's snapshot; before that, a prompt is still routed where this router last sent its blocks;
its own placements count at once."""

from gaas.v1 import kvcache_pb2 as pb
from services.router.kvclient import KVDirectoryClient, RecentPlacements
from services.router.kvreplica import PrefixMatch
from services.router.scheduling import WorkerId


class Directory:
    def __init__(self):
        self.provisions = []

    async def Provision(self, request, timeout=None):
        self.provisions.append(request)


async def test_before_the_replicas_first_snapshot_a_lookup_falls_back_on_the_routers_recent_placements():
    kv = KVDirectoryClient(Directory())
    assert kv.lookup([1, 2, 3]) == PrefixMatch(), "nothing placed yet: no prefix knowledge"
    kv.provision(WorkerId("w1"), [1, 2, 3], "acme")
    assert kv.lookup([1, 2, 3, 4]) == PrefixMatch({"w1": 3}), "three leading blocks sent to w1, none confirmed"
    assert kv.lookup([9, 2, 3]) == PrefixMatch(), "a different first block is a different prefix"
    kv.provision(WorkerId("w0"), [1, 2], "acme")
    assert kv.lookup([1, 2, 3]) == PrefixMatch({"w0": 2}), "the latest placement wins"
    assert kv.unanswered == 4
    await kv.close()


async def test_once_synced_the_replica_answers_and_a_placement_tells_the_directory_its_best_match():
    directory = Directory()
    kv = KVDirectoryClient(directory)
    kv.replica.apply(pb.DirectoryChanges(snapshot=True, changes=[
        pb.BlockChange(kind=pb.BlockChange.STORED, worker_id="w0", hashes=[1, 2])]))
    assert kv.lookup([1, 2, 3]) == PrefixMatch({"w0": 2}, {"w0": 2})
    kv.provision(WorkerId("w1"), [1, 2, 3], "acme", best_matched=2)
    assert kv.lookup([1, 2, 3]) == PrefixMatch({"w0": 2, "w1": 3}, {"w0": 2})
    await kv.close()
    [sent] = directory.provisions
    assert (sent.worker_id, list(sent.block_hashes), sent.best_matched_blocks) == ("w1", [1, 2, 3], 2)
    assert kv.unanswered == 0


def test_recent_placements_are_bounded():
    r = RecentPlacements(capacity=4)
    r.placed(WorkerId("w0"), [1, 2, 3])
    r.placed(WorkerId("w1"), [7, 8, 9])
    assert r.leading([1, 2, 3]) == {} and r.leading([7, 8, 9]) == {"w1": 3}

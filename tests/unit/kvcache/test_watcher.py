"""The directory's watcher with fake workers: a snapshot replaces what was known, a sequence gap
starts the watch over, and a worker that leaves the registry takes its blocks with it."""

import asyncio

from gaas.contracts import kvhash
from gaas.v1 import kvcache_pb2 as pb
from gaas.contracts.ids import WorkerId
from services.kvcache.directory import BlockDirectory
from services.kvcache.watcher import WatchedWorker, WorkerWatcher
from tests.waiting import eventually_async

W = WatchedWorker(WorkerId("worker-0"), "127.0.0.1:1", 2)


def batch(seq, *stored, snapshot=False, epoch=1):
    b = pb.KVEventBatch(worker_id=W.worker_id, seq=seq, epoch=epoch, snapshot=snapshot)
    for hashes, tokens in stored:
        b.events.add(stored=pb.BlockStored(block_hashes=hashes, token_ids=tokens, block_size=2, cache_salt="s"))
    return b


class Fake:
    def __init__(self):
        self.registered = [W]
        self.watches: list[list[pb.KVEventBatch]] = []
        self.started = 0

    async def list_workers(self):
        return self.registered

    async def watch(self, w):
        self.started += 1
        for b in self.watches.pop(0) if self.watches else []:
            yield b
        await asyncio.Event().wait()  # (a watch that stays open)


async def running(watcher, until, what: str):
    """The watcher's task, once until() holds."""
    task = asyncio.create_task(watcher.run())
    await eventually_async(until, 5, every=0.01, what=what)
    return task


async def test_snapshot_then_live_then_a_gap_resynchronises_then_leaving_drops():
    d = BlockDirectory()
    fake = Fake()
    fake.watches = [
        [batch(5, ([1], [1, 2]), snapshot=True), batch(5, ([2], [3, 4])), batch(7, ([3], [5, 6]))],  # a gap at 6
        [batch(9, ([4], [7, 8]), snapshot=True)],
    ]
    watcher = WorkerWatcher(d, fake.list_workers, fake.watch, poll_seconds=0.01, retry_seconds=0.01)
    task = await running(watcher, lambda: fake.started == 2 and d.stats().resyncs == 1,
                         "the gap starting the watch over from a second snapshot")
    assert d.lookup(kvhash.prefix_hashes([7, 8], 2, "s"))[0].matched_blocks == 1
    assert d.lookup(kvhash.prefix_hashes([1, 2], 2, "s")) == [], "the second snapshot replaced the first"
    s = d.stats()
    assert s.sequence_gaps == 1 and s.resyncs == 1
    fake.registered = []
    await eventually_async(lambda: d.stats().blocks == 0 and d.stats().per_worker == [], 5, every=0.01,
                           what="the worker's blocks dropped once it left")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_watch_not_opening_with_a_snapshot_is_started_over():
    d = BlockDirectory()
    fake = Fake()
    fake.watches = [[batch(0, ([1], [1, 2]))], [batch(0, ([1], [1, 2]), snapshot=True)]]
    task = await running(WorkerWatcher(d, fake.list_workers, fake.watch, 0.01, 0.01),
                         lambda: fake.started == 2 and d.stats().blocks == 1, "the watch started over with a snapshot")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)

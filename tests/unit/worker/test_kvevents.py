"""The worker's KV-event relay with a scripted engine: watchers get a snapshot then the live
batches; a gap is filled from the replay buffer; events lost beyond it start a new, empty epoch
(and clear the engine's cache), so no directory keeps believing in blocks that may be gone; a
stopping worker ends its watches at once."""

import asyncio

import pytest

from gaas.contracts import errors
from services.worker import kvevents
from services.worker.kvevents import EventSource, KVEventRelay, RawBatch, RawStored, from_vllm
from tests.waiting import eventually_async


class Script(EventSource):
    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.kept: list[RawBatch] = []

    def emit(self, batch: RawBatch, deliver=True):
        self.kept.append(batch)
        if deliver:
            self.queue.put_nowait(batch)

    async def next(self):
        return await self.queue.get()

    async def replay(self, start_seq):
        return [b for b in self.kept if b.seq >= start_seq]


def stored(hashes, parent=None, salt="s"):
    return RawStored(hashes, parent, list(range(len(hashes) * 2)), 2, salt if parent is None else "", "")


@pytest.fixture
async def relay():
    source = Script()
    resets = []

    async def reset():
        resets.append(1)
        return True

    r = KVEventRelay("worker-0", source, reset)
    task = asyncio.create_task(r.run())
    yield r, source, resets
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def take(it, n):
    return [await asyncio.wait_for(it.__anext__(), 2) for _ in range(n)]


async def test_a_watcher_gets_a_snapshot_then_live_batches(relay):
    r, source, _ = relay
    source.emit(RawBatch(0, [stored([1, 2])]))
    await eventually_async(lambda: r.blocks == 2, what="the batch relayed")
    it = r.watch().__aiter__()
    snap, = await take(it, 1)
    assert snap.snapshot and snap.seq == 1 and [list(e.stored.block_hashes) for e in snap.events] == [[1], [2]]
    assert snap.events[0].stored.cache_salt == "s" and snap.events[1].stored.parent_block_hash == 1
    source.emit(RawBatch(1, [("removed", [2]), stored([3], parent=1)]))
    live, = await take(it, 1)
    assert not live.snapshot and live.seq == 1 and live.epoch == snap.epoch
    assert [e.WhichOneof("event") for e in live.events] == ["removed", "stored"]
    assert r.blocks == 2


async def test_a_gap_is_filled_from_the_replay_buffer(relay):
    r, source, resets = relay
    source.emit(RawBatch(0, [stored([1])]))
    source.emit(RawBatch(1, [stored([2], parent=1)]), deliver=False)  # lost on the PUB socket
    source.emit(RawBatch(2, [stored([3], parent=2)]))
    await eventually_async(lambda: r.last_seq == 2, what="the batches relayed, the lost one replayed")
    assert r.last_seq == 2 and r.blocks == 3 and r.lost == 0 and resets == []


async def test_events_lost_beyond_replay_start_an_empty_epoch_and_clear_the_engine(relay):
    r, source, resets = relay
    source.emit(RawBatch(0, [stored([1])]))
    await eventually_async(lambda: r.blocks == 1, what="the batch relayed")
    it = r.watch().__aiter__()
    snap, = await take(it, 1)
    epoch = r.epoch
    source.kept.clear()  # the replay buffer no longer has batch 1
    source.emit(RawBatch(2, [stored([9])]))
    await eventually_async(lambda: r.lost == 1, what="the loss noticed")
    assert r.lost == 1 and resets == [1] and r.epoch != epoch
    with pytest.raises(StopAsyncIteration):
        await take(it, 1)  # the watch ended: its watcher resynchronises
    again, = await take(r.watch().__aiter__(), 1)
    assert again.epoch == r.epoch and [list(e.stored.block_hashes) for e in again.events] == [[9]]


async def test_a_quiet_watch_gets_heartbeats(relay, monkeypatch):
    r, _, _ = relay
    monkeypatch.setattr(kvevents, "HEARTBEAT_SECONDS", 0.01)
    it = r.watch().__aiter__()
    snap, beat = await take(it, 2)
    assert snap.snapshot and not beat.snapshot and not beat.events and beat.seq == snap.seq


async def test_a_stopping_worker_ends_its_watches_and_takes_no_new_one(relay):
    r, source, _ = relay
    source.emit(RawBatch(0, [stored([1])]))
    await eventually_async(lambda: r.blocks == 1, what="the batch relayed")
    it = r.watch().__aiter__()
    await take(it, 1)
    r.close()
    with pytest.raises(StopAsyncIteration):
        await take(it, 1)  # ended now: the server's stop does not wait out its grace for it
    with pytest.raises(errors.Unavailable):
        await take(r.watch().__aiter__(), 1)


def test_vllm_events_are_read_with_the_salt_of_the_first_block():
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    first = BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2, lora_id=None,
                        medium="GPU", lora_name=None, extra_keys=[("salt-a",), None])
    lora = BlockStored(block_hashes=[13], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=1,
                       medium="GPU", lora_name="ad", extra_keys=[("ad", "salt-b")])
    batch = from_vllm(7, KVEventBatch(ts=0.0, events=[first, lora, BlockRemoved(block_hashes=[12], medium="GPU"),
                                                      AllBlocksCleared()]))
    assert batch.seq == 7
    assert (batch.events[0].cache_salt, batch.events[0].lora_name, batch.events[0].parent) == ("salt-a", "", None)
    assert (batch.events[1].cache_salt, batch.events[1].lora_name) == ("salt-b", "ad")
    assert batch.events[2:] == [("removed", [12]), ("cleared",)]

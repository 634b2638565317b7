"""The router's replica of the KV directory against the directory itself: fed by the directory's
change feed, it answers every lookup as the directory does, whatever the interleaving of stored,
removed and cleared blocks and provisions, their expiry included; a follower that falls behind is
cut off; a snapshot replaces whatever the replica held."""

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from gaas.contracts import kvhash
from gaas.contracts.ids import WorkerId
from gaas.v1 import kvcache_pb2 as pb
from services.kvcache import follow
from services.kvcache.directory import BlockDirectory, Stored
from services.router.kvreplica import Follower, PrefixMatch, Replica
from tests.fakeclock import FakeClock

BS = 2
A, B, C = WorkerId("worker-a"), WorkerId("worker-b"), WorkerId("worker-c")


def stored(worker_salt: str, tokens, base: int) -> Stored:
    n = len(tokens) // BS
    return Stored([base + i for i in range(n)], None, tokens[: n * BS], BS, worker_salt)


def as_match(matches) -> PrefixMatch:
    return PrefixMatch({m.worker_id: m.matched_blocks for m in matches},
                       {m.worker_id: m.confirmed_blocks for m in matches if m.confirmed_blocks})


def drain(q: asyncio.Queue, replica: Replica) -> None:
    while not q.empty():
        replica.apply(q.get_nowait())


_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "clear", "provision", "leave", "wait"]),
        st.sampled_from([A, B, C]),
        st.sampled_from(["s1", "s2"]),
        st.lists(st.integers(0, 2), min_size=2, max_size=8),
        st.integers(0, 40),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, late=st.integers(0, 40))
def test_a_replica_fed_by_the_directory_answers_every_lookup_as_the_directory_does(ops, late):
    clock = FakeClock()
    d = BlockDirectory(BS, provision_ttl_seconds=10, clock=clock)
    replica = Replica(clock=clock)
    q = None
    base = 1000
    for i, (op, worker, salt, tokens, pick) in enumerate(ops):
        if i == late:  # the router starts following here: a snapshot, then the changes
            q = d.feed.subscribe()
            for msg in d.snapshot():
                replica.apply(msg)
        if op == "store":
            base += 100
            if len(tokens) >= BS:
                d.stored(worker, stored(salt, tokens, base))
        elif op == "remove":
            d.removed(worker, [1000 + pick * 10 + k for k in range(3)] + [base + pick % 4])
        elif op == "clear":
            d.cleared(worker)
        elif op == "provision":
            d.provision(worker, kvhash.prefix_hashes(tokens, BS, salt))
        elif op == "leave":
            d.drop_worker(worker)
        elif op == "wait":
            clock.advance(pick / 4)
        d.feed.flush()
        if q is not None:
            drain(q, replica)
            prompt = kvhash.prefix_hashes(tokens, BS, salt)
            assert replica.lookup(prompt) == as_match(d.lookup(prompt)), (op, worker, salt, tokens)


def test_a_snapshot_replaces_what_the_replica_held():
    r = Replica()
    r.apply(pb.DirectoryChanges(snapshot=True, changes=[pb.BlockChange(kind=pb.BlockChange.STORED, worker_id=A,
                                                                       hashes=[1, 2, 3])]))
    assert r.synced and r.lookup([1, 2]) == PrefixMatch({A: 2}, {A: 2})
    r.apply(pb.DirectoryChanges(snapshot=True, changes=[pb.BlockChange(kind=pb.BlockChange.STORED, worker_id=B,
                                                                       hashes=[1])]))
    assert r.lookup([1, 2]) == PrefixMatch({B: 1}, {B: 1}) and r.blocks == 1


def test_a_large_snapshot_comes_in_bounded_messages_the_first_marked():
    held = {A: range(follow.SNAPSHOT_HASHES + 5), B: range(7)}
    msgs = follow.snapshot_messages(held, {C: [0]}, 30.0)
    assert [m.snapshot for m in msgs] == [True, False]
    assert all(sum(len(c.hashes) for c in m.changes) <= follow.SNAPSHOT_HASHES for m in msgs)
    r = Replica()
    for m in msgs:
        r.apply(m)
    assert r.blocks == follow.SNAPSHOT_HASHES + 5 and r.lookup([0]).matched == {A: 1, B: 1, C: 1}


async def test_a_follower_that_falls_behind_is_cut_off_and_follows_again_from_a_snapshot(monkeypatch):
    monkeypatch.setattr(follow, "MAX_QUEUED", 3)
    d = BlockDirectory(BS)
    stream = d.feed.follow(d.snapshot())
    assert (await stream.__anext__()).snapshot
    for i in range(5):  # nobody reads: the fourth message cuts it off
        d.stored(A, stored("s", [1, 2], 10 * i))
        d.feed.flush()
    assert [m.snapshot async for m in stream] == [False, False, False] and d.feed.cut_off == 1
    assert d.feed.followers == 0

    calls = []

    async def follow_again():
        calls.append(len(calls))
        for msg in d.snapshot():
            yield msg
        if len(calls) > 1:
            raise asyncio.CancelledError  # (ends the test's follower)

    replica = Replica()
    follower = Follower(replica, follow_again, retry_seconds=0)
    try:
        await follower.run()
    except asyncio.CancelledError:
        pass
    assert calls == [0, 1] and replica.synced and replica.snapshots == 2
    assert replica.lookup(kvhash.prefix_hashes([1, 2], BS, "s")).matched == {A: 1}


def test_changes_recorded_within_one_turn_go_out_as_one_message_in_order():
    d = BlockDirectory(BS)
    q = d.feed.subscribe()
    d.stored(A, stored("s", [1, 2, 3, 4], 10))
    d.cleared(A)
    d.stored(A, stored("s", [1, 2], 20))
    d.feed.event_emitted(123.0)
    d.feed.flush()
    msg = q.get_nowait()
    assert [c.kind for c in msg.changes] == [follow.STORED, follow.CLEARED, follow.STORED]
    assert msg.oldest_event_unix == 123.0 and q.empty()

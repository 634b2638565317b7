"""The KV directory against a reference model: whatever the interleaving of stored / removed /
cleared events across workers, a lookup answers what the engines hold; tenants (salts) never
match each other's blocks; provisions count at once and lapse unless confirmed; the figures."""

from hypothesis import given, settings
from hypothesis import strategies as st

from gaas.contracts import kvhash
from gaas.contracts.ids import WorkerId
from services.kvcache.directory import BlockDirectory, Stored
from tests.fakeclock import FakeClock

BS = 2
A, B = WorkerId("worker-a"), WorkerId("worker-b")


def hashes(tokens, salt="s"):
    return kvhash.prefix_hashes(tokens, BS, salt)


class Engine:
    """A fake engine's block table: engine hash -> (salt, token prefix), and the events it emits."""

    def __init__(self, name):
        self.name = name
        self.blocks: dict[int, tuple[str, tuple]] = {}
        self._next = hash(name) & 0xFFFF_0000

    def store(self, salt, tokens, parent=None):
        """Store the full blocks of tokens after parent (an engine hash) or from the start."""
        base = self.blocks[parent][1] if parent is not None else ()
        out = []
        for i in range(0, len(tokens) - BS + 1, BS):
            self._next += 1
            base = base + tuple(tokens[i:i + BS])
            self.blocks[self._next] = (salt, base)
            out.append(self._next)
        return Stored(out, parent, tokens[: len(out) * BS], BS, salt if parent is None else "")


def reference_lookup(engines, salt, tokens):
    out = {}
    for name, e in engines.items():
        held = set(e.blocks.values())
        k = 0
        while (k + 1) * BS <= len(tokens) and (salt, tuple(tokens[: (k + 1) * BS])) in held:
            k += 1
        if k:
            out[name] = k
    return out


def test_lookup_counts_leading_blocks_per_worker():
    d = BlockDirectory(BS)
    ea, eb = Engine(A), Engine(B)
    d.stored(A, ea.store("s", [1, 2, 3, 4, 5, 6]))
    d.stored(B, eb.store("s", [1, 2, 3, 4, 9, 9]))
    got = {m.worker_id: (m.matched_blocks, m.confirmed_blocks) for m in d.lookup(hashes([1, 2, 3, 4, 5, 6, 7, 8]))}
    assert got == {A: (3, 3), B: (2, 2)}


def test_a_chain_continued_by_a_later_event_is_followed():
    d, e = BlockDirectory(BS), Engine(A)
    first = e.store("s", [1, 2])
    d.stored(A, first)
    d.stored(A, e.store("s", [3, 4, 5, 6], parent=first.engine_hashes[-1]))
    assert d.lookup(hashes([1, 2, 3, 4, 5, 6]))[0].matched_blocks == 3


def test_tenants_never_match_each_others_blocks():
    d, e = BlockDirectory(BS), Engine(A)
    d.stored(A, e.store("salt-acme", [1, 2, 3, 4]))
    assert d.lookup(hashes([1, 2, 3, 4], "salt-beta")) == []
    assert d.lookup(hashes([1, 2, 3, 4], "salt-acme"))[0].matched_blocks == 2


def test_removed_and_cleared_blocks_stop_matching_and_a_lost_parent_makes_blocks_unreachable():
    d, e = BlockDirectory(BS), Engine(A)
    ev = e.store("s", [1, 2, 3, 4, 5, 6])
    d.stored(A, ev)
    d.removed(A, [ev.engine_hashes[0]])  # the first block evicted before its children
    assert d.lookup(hashes([1, 2, 3, 4, 5, 6])) == []
    stats = d.stats()
    assert stats.per_worker[0].blocks == 2 and stats.per_worker[0].unreachable_blocks == 1
    assert stats.fragmentation == 0.5
    d.cleared(A)
    assert d.stats().blocks == 0


def test_unchained_and_wrong_sized_blocks_are_not_indexed_but_counted():
    d = BlockDirectory(BS)
    d.stored(A, Stored([7], 12345, [1, 2], BS))  # its parent was never reported
    d.stored(A, Stored([8], None, [1, 2, 3, 4], 4))  # blocks of 4 tokens in a directory of 2
    s = d.stats()
    assert (s.blocks, s.unchained_blocks, s.wrong_size_blocks) == (0, 1, 1)


def test_provisions_count_at_once_then_are_confirmed_or_lapse():
    clock = FakeClock()
    d = BlockDirectory(BS, provision_ttl_seconds=10, clock=clock)
    e = Engine(A)
    hs = hashes([1, 2, 3, 4])
    d.provision(A, hs, tenant="acme")
    m = d.lookup(hs)[0]
    assert (m.worker_id, m.matched_blocks, m.confirmed_blocks) == (A, 2, 0)
    d.stored(A, e.store("s", [1, 2]))  # the engine confirms the first block
    m = d.lookup(hs)[0]
    assert (m.matched_blocks, m.confirmed_blocks) == (2, 1)
    clock.now = 11
    m = d.lookup(hs)[0]
    assert (m.matched_blocks, m.confirmed_blocks) == (1, 1), "the unconfirmed block lapsed"
    s = d.stats()
    assert (s.provisioned, s.provision_confirmed, s.provision_expired) == (2, 1, 1)
    assert s.per_tenant == {"acme": 1}


def test_sequence_gaps_and_resyncs():
    d = BlockDirectory(BS)
    d.resync(A, epoch=1, next_seq=5)
    assert d.note_seq(A, 1, 5) and d.note_seq(A, 1, 6)
    assert not d.note_seq(A, 1, 8), "a gap"
    assert not d.note_seq(A, 2, 7), "another epoch"
    e = Engine(A)
    d.stored(A, e.store("s", [1, 2]))
    d.resync(A, epoch=2, next_seq=0)
    s = d.stats()
    assert (s.sequence_gaps, s.resyncs, s.blocks) == (2, 1, 0)


def test_a_worker_that_leaves_takes_its_blocks_and_provisions():
    d, e = BlockDirectory(BS), Engine(A)
    d.stored(A, e.store("s", [1, 2]))
    d.provision(A, hashes([1, 2, 3, 4]))
    d.drop_worker(A)
    assert d.lookup(hashes([1, 2, 3, 4])) == [] and d.stats().blocks == 0


_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "extend", "remove", "clear", "lookup"]),
        st.sampled_from([A, B]),
        st.sampled_from(["s1", "s2"]),
        st.lists(st.integers(0, 2), min_size=2, max_size=8),
        st.integers(0, 50),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops)
def test_directory_agrees_with_the_reference_model(ops):
    d = BlockDirectory(BS)
    engines = {A: Engine(A), B: Engine(B)}
    for op, worker, salt, tokens, pick in ops:
        e = engines[worker]
        if op == "store":
            ev = e.store(salt, tokens)
            if ev.engine_hashes:
                d.stored(worker, ev)
        elif op == "extend" and e.blocks:
            parent = sorted(e.blocks)[pick % len(e.blocks)]
            ev = e.store(e.blocks[parent][0], tokens, parent=parent)
            if ev.engine_hashes:
                d.stored(worker, ev)
        elif op == "remove" and e.blocks:
            h = sorted(e.blocks)[pick % len(e.blocks)]
            del e.blocks[h]
            d.removed(worker, [h])
        elif op == "clear":
            e.blocks.clear()
            d.cleared(worker)
        got = {m.worker_id: m.matched_blocks for m in d.lookup(hashes(tokens, salt))}
        assert got == reference_lookup(engines, salt, tokens), (op, worker, salt, tokens)

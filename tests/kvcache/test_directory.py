import pytest

from services.kvcache.directory import BlockDirectory, Match, WorkerId

A, B = WorkerId("worker-0"), WorkerId("worker-1")


@pytest.fixture
def d():
    d = BlockDirectory()
    d.stored(A, [1, 2, 3])
    d.stored(B, [1, 2])
    return d


@pytest.mark.parametrize(
    "hashes, expected",
    [
        ([1, 2, 3, 4], [Match(A, 3), Match(B, 2)]),
        ([1, 2], [Match(A, 2), Match(B, 2)]),
        ([1, 9, 3], [Match(A, 1), Match(B, 1)]),
        ([2, 3], [Match(A, 2), Match(B, 1)]),
        ([9], []),
        ([], []),
    ],
)
def test_longest_prefix(d, hashes, expected):
    assert d.lookup(hashes) == expected


def test_removal_and_clear(d):
    d.removed(A, [2])
    assert d.lookup([1, 2, 3]) == [Match(B, 2), Match(A, 1)]
    d.cleared(B)
    assert d.lookup([1, 2, 3]) == [Match(A, 1)]
    assert d.workers == 1 and d.blocks == 2
    assert d.events == 4

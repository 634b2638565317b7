import pytest

from gaas import errors
from services.router.picker import Candidate, RoundRobinPicker, WorkerId, make_picker


def cands(*ids):
    return [Candidate(WorkerId(i), f"127.0.0.1:{n}", "m", "1", 2048) for n, i in enumerate(ids)]


def test_round_robin_cycles_in_id_order():
    p = RoundRobinPicker()
    picks = [p.pick(cands("w-b", "w-a", "w-c")).worker_id for _ in range(6)]
    assert picks == ["w-a", "w-b", "w-c", "w-a", "w-b", "w-c"]


def test_empty_is_a_typed_error():
    with pytest.raises(errors.Unavailable):
        RoundRobinPicker().pick([])


def test_registry():
    assert isinstance(make_picker("round_robin"), RoundRobinPicker)
    with pytest.raises(ValueError, match="unknown picker 'fastest'"):
        make_picker("fastest")

import pytest

from gaas.contracts.rollout import Split, State


@pytest.mark.parametrize("kw, message", [
    ({"stable": ""}, "needs its stable version"),
    ({"canary": "2", "weight": 101}, "weight must be 0..100"),
    ({"canary": "2", "shadow": -1}, "shadow must be 0..100"),
    ({"canary": "1"}, "canary and stable are both version 1"),
    ({"weight": 5}, "needs a canary version"),
])
def test_a_split_that_cannot_be_applied_is_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        Split(**{"model": "m", "stable": "1", **kw})


@pytest.mark.parametrize("split, version, serves", [
    (Split("m", "1"), "1", True),
    (Split("m", "1"), "", False),
    (Split("m", "1", canary="2", weight=0), "2", False),
    (Split("m", "1", canary="2", weight=5), "2", True),
    (Split("m", "1", canary="2", weight=100), "1", False),
    (Split("m", "1", canary="2", weight=100), "2", True),
])
def test_which_versions_take_new_requests(split, version, serves):
    assert split.serves(version) is serves


def test_only_the_three_ends_are_ended():
    assert {s for s in State if s.ended} == {State.PROMOTED, State.ROLLED_BACK, State.HALTED}

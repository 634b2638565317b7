"""The routers' choice of version: pins, sessions, and the weighted split's accuracy."""

from hypothesis import given
from hypothesis import strategies as st

from gaas.contracts.rollout import Split
from services.router.versions import VersionChooser


@given(weight=st.integers(0, 100), n=st.integers(1, 3000))
def test_the_split_is_within_one_request_of_its_weight(weight, n):
    chooser, split = VersionChooser(), Split("m", stable="1", canary="2", weight=weight)
    canary = sum(chooser.choose(split) == "2" for _ in range(n))
    assert abs(canary - n * weight / 100) < 1


@given(weight=st.integers(1, 99), pattern=st.lists(st.sampled_from("abc"), min_size=1, max_size=7))
def test_each_tenant_gets_the_weight_whatever_the_others_rhythm(weight, pattern):
    """Tenants whose requests interleave in a fixed rhythm: each one's share is the weight (one
    credit for all would give a tenant in step with the others all or nothing of the canary)."""
    chooser, split = VersionChooser(), Split("m", stable="1", canary="2", weight=weight)
    got: dict[str, list[str]] = {}
    for _ in range(300):
        for tenant in pattern:
            got.setdefault(tenant, []).append(chooser.choose(split, tenant=tenant))
    for tenant, versions in got.items():
        assert abs(versions.count("2") - len(versions) * weight / 100) < 1


@given(weights=st.lists(st.integers(0, 100), min_size=1, max_size=6))
def test_over_1000_requests_each_step_is_within_2_points_of_its_weight(weights):
    """A rollout steps through weights on the same chooser: each step's share stands on its own."""
    chooser = VersionChooser()
    for w in weights:
        split = Split("m", stable="1", canary="2", weight=w)
        share = sum(chooser.choose(split) == "2" for _ in range(1000)) / 1000
        assert abs(share - w / 100) <= 0.02


def test_models_keep_their_own_credit():
    chooser = VersionChooser(start=lambda: 0)
    a, b = Split("a", stable="1", canary="2", weight=50), Split("b", stable="1", canary="2", weight=50)
    picks = [(chooser.choose(a), chooser.choose(b)) for _ in range(4)]
    assert [p[0] for p in picks] == ["1", "2", "1", "2"] and [p[1] for p in picks] == ["1", "2", "1", "2"]


def test_a_pinned_tenant_takes_its_version_and_a_session_keeps_its_own():
    chooser = VersionChooser()
    split = Split("m", stable="1", canary="2", weight=0, pins={"acme": "2"})
    assert chooser.choose(split, tenant="acme") == "2", "a pin holds even at weight 0"
    assert chooser.choose(split, tenant="other") == "1"
    switched = Split("m", stable="1", canary="2", weight=100, pins={"acme": "1"})
    assert chooser.choose(switched, tenant="acme") == "1", "the old version kept warm serves its pinned tenants"
    canary = Split("m", stable="1", canary="2", weight=5)
    assert all(chooser.choose(canary, session_version="2") == "2" for _ in range(10))
    assert chooser.choose(Split("m", stable="1"), session_version="2") == "1", "a version rolled back keeps no session"
    assert chooser.choose(Split("m", stable="1", pins={"acme": "9"}), tenant="acme") == "1", "a pin to no serving version"


def test_shadow_copies_their_share():
    chooser = VersionChooser()
    split = Split("m", stable="1", canary="2", weight=0, shadow=10)
    assert abs(sum(chooser.shadow(split) for _ in range(1000)) - 100) < 1
    assert not any(chooser.shadow(Split("m", stable="1")) for _ in range(10))


def test_only_versions_with_workers_and_open_to_the_tenant_are_chosen():
    chooser = VersionChooser()
    split = Split("m", stable="1", canary="2", weight=50, tenants={"2": frozenset({"beta"})})
    assert {chooser.choose(split, tenant="acme") for _ in range(10)} == {"1"}, "2 is beta's only"
    assert {chooser.choose(split, tenant="beta") for _ in range(10)} == {"1", "2"}
    assert chooser.choose(split, tenant="beta", available={"2"}) == "2", "1 has no workers now"
    switched = Split("m", stable="1", canary="2", weight=100)
    assert chooser.choose(switched, available={"1"}) == "1", "the old version kept warm takes it while 2 has none"
    import pytest

    from gaas.contracts import errors

    with pytest.raises(errors.PermissionDenied, match="not available to this tenant"):
        chooser.choose(Split("m", stable="1", tenants={"1": frozenset({"beta"})}), tenant="acme")


def test_a_session_stays_on_its_version_while_it_serves_even_switched_away_from():
    chooser = VersionChooser()
    switched = Split("m", stable="1", canary="2", weight=100)
    assert chooser.choose(switched, session_version="1") == "1"
    assert chooser.choose(switched) == "2"

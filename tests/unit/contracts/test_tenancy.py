"""The tiers are one list (gaas.contracts.tenancy): the bands, the wire's enum, the default policies and
the fallback for a tier nobody named all follow it."""

from gaas.contracts import qos, tenancy


def test_tiers_are_served_highest_first_and_an_unknown_tier_is_the_lowest():
    assert tenancy.TIERS == ("bronze", "silver", "gold")
    assert tenancy.TIERS_BY_PRIORITY == ("gold", "silver", "bronze")
    # Batch requests have a band of their own, below every tier's.
    assert qos.BAND_NAMES == ("gold", "silver", "bronze", qos.BATCH)
    assert [qos.band(t) for t in qos.BAND_NAMES] == [0, 1, 2, 3]
    assert qos.engine_priority(qos.BATCH, 0) > qos.engine_priority("bronze", 0)
    assert tenancy.DEFAULT_TIER == "bronze" and qos.band("platinum") == qos.band(tenancy.DEFAULT_TIER)


def test_every_tier_has_a_wire_value_and_a_default_policy():
    assert set(tenancy.TIER_TO_PB) == set(tenancy.TIERS) == set(qos.DEFAULT_POLICIES)
    assert {tenancy.TIER_FROM_PB[v] for v in tenancy.TIER_TO_PB.values()} == set(tenancy.TIERS)

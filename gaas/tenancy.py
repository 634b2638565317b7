"""Tenant tiers, shared by the control plane (which stores them) and the router (which acts on them)."""

from gaas.v1 import control_pb2

TIERS = ("bronze", "silver", "gold")
TIER_TO_PB = {"bronze": control_pb2.TIER_BRONZE, "silver": control_pb2.TIER_SILVER, "gold": control_pb2.TIER_GOLD}
TIER_FROM_PB = {v: k for k, v in TIER_TO_PB.items()}

"""Tenant names and tiers, shared by the control plane (which stores them) and the router (which acts
on them)."""

import re

from gaas.v1 import control_pb2

# A tenant's name (it is also part of Redis keys, inside a {hash tag}).
# Matched whole (fullmatch: "$" would let a trailing newline through).
TENANT_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")

TIERS = ("bronze", "silver", "gold")
TIER_TO_PB = {"bronze": control_pb2.TIER_BRONZE, "silver": control_pb2.TIER_SILVER, "gold": control_pb2.TIER_GOLD}
TIER_FROM_PB = {v: k for k, v in TIER_TO_PB.items()}

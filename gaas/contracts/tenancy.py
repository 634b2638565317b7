"""Tenant names and tiers, shared by the control plane (which stores them) and the router (which acts
on them)."""

import re

from gaas.v1 import control_pb2

# A tenant's name (it is also part of Redis keys, inside a {hash tag}).
# Matched whole (fullmatch: "$" would let a trailing newline through).
TENANT_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")

# The service tiers, lowest first: the one list every process and the deployment file take tiers from.
TIERS = ("bronze", "silver", "gold")
# Highest first: the order tiers are served in (gaas/contracts/qos.py's priority bands) and listed in.
TIERS_BY_PRIORITY = tuple(reversed(TIERS))
# A new tenant's tier unless it names one, and what a tier a peer did not name (or an unknown one) counts as.
DEFAULT_TIER = TIERS[0]
TIER_TO_PB = {"bronze": control_pb2.TIER_BRONZE, "silver": control_pb2.TIER_SILVER, "gold": control_pb2.TIER_GOLD}
TIER_FROM_PB = {v: k for k, v in TIER_TO_PB.items()}

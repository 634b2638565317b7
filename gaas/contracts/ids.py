"""Ids that cross process boundaries and must not be mixed with other strings. Pure: no I/O."""

from __future__ import annotations

import re
from typing import NewType

# A worker's id: what it registers with control under, what the KV directory files its blocks under,
# and what a router schedules, breaks and counts by.
WorkerId = NewType("WorkerId", str)

# A tenant's name, as control stores it and every request carries it (x-gaas-tenant).
TenantId = NewType("TenantId", str)

# A model's name (the deployment file's) and a LoRA adapter's (the catalogue's): one namespace, no
# ':' (a request names an adapter as "model:adapter"), at most 63 characters.
MODEL_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")

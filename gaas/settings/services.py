"""Each service's settings class, by service (the services of gaas.ops.topology.SERVICES, in their
start order)."""

from __future__ import annotations

from gaas.settings.billing import BillingSettings
from gaas.settings.control import ControlSettings
from gaas.settings.kvcache import KVCacheSettings
from gaas.settings.router import RouterSettings
from gaas.settings.worker import WorkerSettings

SETTINGS: dict[str, type] = {
    "control": ControlSettings,
    "kvcache": KVCacheSettings,
    "billing": BillingSettings,
    "worker": WorkerSettings,
    "router": RouterSettings,
}

"""The scheduler's plugins by kind and name, as the Gateway API Inference Extension's plugin
registry holds them: each filter, scorer and picker registers itself where it is defined
(@plugin(kind), under its class's name), and each plugin folder (filters/, scorers/, pickers/)
loads every module in it, so a new plugin is one new file. Profiles name their plugins
(gaas/settings/router.py's PROFILES); make_scheduler (profiles.py) builds them from here. The hooks
around a scheduling cycle are built with what they count and tell, by stages.py."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable

KINDS = ("filter", "scorer", "picker")
# The folder of each kind's plugins.
PACKAGES = {"filter": "services.router.scheduling.filters", "scorer": "services.router.scheduling.scorers",
            "picker": "services.router.scheduling.pickers"}

_PLUGINS: dict[str, dict[str, type]] = {kind: {} for kind in KINDS}


def plugin(kind: str):
    """Register the decorated class as a plugin of this kind, under its `name`."""
    def register(cls: type) -> type:
        known = _PLUGINS[kind]
        if cls.name in known and known[cls.name] is not cls:
            raise ValueError(f"two {kind} plugins are named {cls.name!r}: {known[cls.name].__qualname__} and "
                             f"{cls.__qualname__}")
        known[cls.name] = cls
        return cls

    return register


def load_package(package: str, path: Iterable[str]) -> None:
    """Import every module of a plugin folder (its __init__ calls this), so each registers itself."""
    for module in pkgutil.iter_modules(path):
        importlib.import_module(f"{package}.{module.name}")


def plugins(kind: str) -> dict[str, type]:
    """The plugins of a kind, by name."""
    importlib.import_module(PACKAGES[kind])
    return dict(_PLUGINS[kind])


def get(kind: str, name: str, where: str = "") -> type:
    """The plugin of this kind and name; ValueError naming the ones there are."""
    known = plugins(kind)
    if name not in known:
        raise ValueError(f"unknown {kind} {name!r}{f' in {where}' if where else ''}; {kind}s: {', '.join(sorted(known))}")
    return known[name]

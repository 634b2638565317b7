"""The scheduler's scorers, one per file; each registers itself by name (registry.plugin)."""

from services.router.scheduling.registry import load_package

load_package(__name__, __path__)

"""The router's settings: gaas/settings/router.py declares them (each variable, default and help,
once); RouterConfig is their name here."""

from gaas.settings.router import REGISTRY_REFRESH_SECONDS, RouterSettings as RouterConfig

__all__ = ["REGISTRY_REFRESH_SECONDS", "RouterConfig"]

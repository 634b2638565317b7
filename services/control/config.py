"""Control's settings: gaas/settings/control.py declares them (each variable, default and help,
once); ControlConfig is their name here."""

from gaas.settings.control import ControlSettings as ControlConfig

__all__ = ["ControlConfig"]

"""The worker's settings: gaas/settings/worker.py declares them (each variable, default and help,
once); WorkerConfig is their name here."""

from gaas.settings.worker import WorkerSettings as WorkerConfig

__all__ = ["WorkerConfig"]

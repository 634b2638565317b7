"""The KV directory's settings: gaas/settings/kvcache.py declares them (each variable, default and
help, once); KVCacheConfig is their name here."""

from gaas.settings.kvcache import KVCacheSettings as KVCacheConfig

__all__ = ["KVCacheConfig"]

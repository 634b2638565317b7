"""Reading a service's settings from GAAS_* environment variables, with errors that name them."""

from __future__ import annotations

from collections.abc import Mapping


class ConfigError(ValueError):
    """A setting is missing or malformed; the message names the variable."""


def env_str(env: Mapping[str, str], name: str, default: str | None = None) -> str:
    value = env.get(name, default)
    if value is None or value == "":
        if default is not None:
            return default
        raise ConfigError(f"{name} is required")
    return value


def env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None


def env_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None


def env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {raw!r}")


def base_settings(env: Mapping[str, str], instance: str, port: int) -> dict:
    """The settings every service has: GAAS_INSTANCE, GAAS_HOST, GAAS_PORT, GAAS_LISTEN (a Unix
    socket, unix:/path, to serve on instead of host:port), GAAS_METRICS_PORT (-1: no /metrics) and
    GAAS_GRACE_SECONDS (time running calls get at shutdown)."""
    listen = env_str(env, "GAAS_LISTEN", "")
    if listen and not listen.startswith("unix:"):
        raise ConfigError(f"GAAS_LISTEN must be unix:/path/to/socket, got {listen!r}")
    return {
        "instance": env_str(env, "GAAS_INSTANCE", instance),
        "host": env_str(env, "GAAS_HOST", "127.0.0.1"),
        "port": env_int(env, "GAAS_PORT", port),
        "listen": listen,
        "metrics_port": env_int(env, "GAAS_METRICS_PORT", -1),
        "grace_seconds": env_float(env, "GAAS_GRACE_SECONDS", 10.0),
    }

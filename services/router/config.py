"""Router settings, read once at start-up from GAAS_* variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gaas.contracts import edge
from gaas.settings.env import ConfigError, base_settings, env_float, env_int, env_str
from services.router.scheduling.profiles import PROFILES, parse_weights


def _policy(name: str) -> str:
    if name not in PROFILES:
        raise ConfigError(f"GAAS_ROUTER_POLICY must be one of {', '.join(PROFILES)}, got {name!r}")
    return name


def _weights(spec: str) -> dict:
    try:
        return parse_weights(spec)
    except ValueError as exc:
        raise ConfigError(f"GAAS_ROUTER_WEIGHTS: {exc}") from None


def _on_off(value: str) -> bool:
    if value.lower() not in ("on", "off"):
        raise ConfigError(f"GAAS_QOS must be on or off, got {value!r}")
    return value.lower() == "on"


# How often a router refreshes its view of the mesh from control, by default.
REGISTRY_REFRESH_SECONDS = 0.5


@dataclass(frozen=True, slots=True)
class RouterConfig:
    instance: str
    host: str
    # gRPC port (the sidecar's inbound listener forwards here).
    port: int
    # unix:/path: listen on that Unix socket instead of host:port (only the sidecar can reach it).
    listen: str
    # /metrics port, or -1 for none.
    metrics_port: int
    # host:port of the sidecar's outbound listener: control, kvcache and workers are reached there.
    outbound: str
    # Scheduling profile (services/router/scheduling/profiles.py): kv_aware, least_load, round_robin.
    policy: str
    # Scorer weights overriding the profile's ("prefix=3,queue=2").
    weights: dict
    # How often the view of the mesh (workers and their load) is refreshed from control.
    registry_refresh_seconds: float
    # Longest wait for the KV directory's answer before scheduling without it.
    kv_lookup_timeout_seconds: float
    # Other workers tried when one fails before its first token.
    retries: int
    # Flow control (services/router/flow.py): on, or off for comparison.
    qos: bool
    # Most requests waiting in the router's queue; batching windows' start, floor and ceiling.
    max_waiting: int
    window_initial: int
    window_min: int
    window_max: int
    # Seconds a worker whose circuit breaker opened is left alone before a probe.
    breaker_cooldown_seconds: float
    # The deployment file (the tiers' TTFT targets and queue timeouts); "" for the defaults.
    deploy_file: str
    # Longest a generation may stream when the client set no deadline.
    max_stream_seconds: float
    # Seconds an API key lookup is reused (a revoked key stops working within this).
    auth_cache_seconds: float
    # While control is unreachable: how long the last view of the mesh and verified keys are used.
    max_stale_seconds: float
    # Adaptive coalescing (services/router/coalescing.py): streams in flight per token of a
    # message (0: one token a message always), and the most tokens a message.
    coalesce_per_step: int
    coalesce_max: int
    # Largest OpenAI-API request body accepted.
    max_body_bytes: int
    # Redis: usage events, budgets.
    redis_url: str
    # Where usage events wait while Redis does not answer.
    spool_dir: str
    grace_seconds: float

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "RouterConfig":
        return cls(
            **base_settings(env, "router-0", 50071),
            outbound=env_str(env, "GAAS_OUTBOUND"),
            policy=_policy(env_str(env, "GAAS_ROUTER_POLICY", "kv_aware")),
            weights=_weights(env.get("GAAS_ROUTER_WEIGHTS", "")),
            registry_refresh_seconds=env_float(env, "GAAS_REGISTRY_REFRESH_SECONDS", REGISTRY_REFRESH_SECONDS),
            kv_lookup_timeout_seconds=env_float(env, "GAAS_KV_LOOKUP_TIMEOUT", 0.05),
            retries=env_int(env, "GAAS_ROUTER_RETRIES", 2),
            qos=_on_off(env_str(env, "GAAS_QOS", "on")),
            max_waiting=env_int(env, "GAAS_QUEUE_MAX", 256),
            window_initial=env_int(env, "GAAS_WINDOW_INITIAL", 8),
            window_min=env_int(env, "GAAS_WINDOW_MIN", 4),
            window_max=env_int(env, "GAAS_WINDOW_MAX", 64),
            breaker_cooldown_seconds=env_float(env, "GAAS_BREAKER_COOLDOWN_SECONDS", 5.0),
            deploy_file=env_str(env, "GAAS_DEPLOY_FILE", ""),
            max_stream_seconds=env_float(env, "GAAS_MAX_STREAM_SECONDS", edge.MAX_STREAM_SECONDS),
            auth_cache_seconds=env_float(env, "GAAS_AUTH_CACHE_SECONDS", 2.0),
            max_stale_seconds=env_float(env, "GAAS_MAX_STALE_SECONDS", 60.0),
            max_body_bytes=env_int(env, "GAAS_MAX_BODY_BYTES", edge.MAX_BODY_BYTES),
            coalesce_per_step=env_int(env, "GAAS_COALESCE_PER_STEP", 2),
            coalesce_max=env_int(env, "GAAS_COALESCE_MAX", 8),
            redis_url=env_str(env, "GAAS_REDIS_URL", "redis://127.0.0.1:6379/0"),
            spool_dir=env_str(env, "GAAS_SPOOL_DIR", ".gaas/spool"),
        )

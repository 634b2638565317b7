"""The router's settings (services/router), read once at start-up from GAAS_* variables, and the
scheduling profiles GAAS_ROUTER_POLICY names (the `gaas` CLI lists them too)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gaas.contracts import edge
from gaas.settings import common
from gaas.settings.env import REQUIRED, ConfigError, Kind, Settings, setting, value_from_env


@dataclass(frozen=True, slots=True)
class Profile:
    """A scheduling profile: the filters it applies (in order), the scorers it weighs and its
    picker, each by the name its plugin registers under (services/router/scheduling/registry.py:
    a profile naming one that does not exist is refused when the router builds its scheduler)."""

    filters: tuple[str, ...]
    weights: Mapping[str, float]
    picker: str


# Every profile keeps the workers serving the model and version, not yet tried for this request,
# with a closed breaker, room for the context, the adapter, and room in their batching window.
FILTERS = ("model", "not_tried", "breaker", "context_fit", "adapter", "window")

PROFILES: dict[str, Profile] = {
    "round_robin": Profile(FILTERS, {}, "round_robin"),
    # Saturated workers are filtered out (unless every worker is).
    "least_load": Profile((*FILTERS, "saturation"), {"queue": 2.0, "kv_usage": 1.0, "adapter_affinity": 1.0},
                          "max_score"),
    # Where the prefix lives, unless load says otherwise: a full prefix outweighs a moderate queue
    # (the engine skips that prefill), a long one does not, and saturated workers are filtered out.
    # A session's turn also leans to the worker of its last turn (what the directory may not know yet),
    # and a request with a LoRA adapter to a worker that holds it (loading one costs a prefill or more).
    "kv_aware": Profile((*FILTERS, "saturation"), {"prefix": 3.0, "queue": 2.0, "kv_usage": 0.5,
                                                   "device_memory": 0.25, "session": 1.0, "adapter_affinity": 1.5},
                        "max_score"),
}

# How often a router refreshes its view of the mesh from control, by default.
REGISTRY_REFRESH_SECONDS = 0.5


def parse_weights(spec: str) -> dict[str, float]:
    """'prefix=3,queue=2' -> {'prefix': 3.0, 'queue': 2.0}; ValueError naming what is wrong (the
    scorers' names are checked against the registered ones when the router builds its scheduler)."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        if not name.isidentifier():
            raise ValueError(f"a weight is written name=number, got {part!r}")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"the weight of {name} must be a number, got {value!r}") from None
    return out


def _read_weights(name: str, text: str) -> dict[str, float]:
    try:
        return parse_weights(text)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _write_weights(weights: dict[str, float]) -> str:
    return ",".join(f"{k}={v:g}" for k, v in weights.items())


def _read_on_off(name: str, text: str) -> bool:
    if text.lower() not in ("on", "off"):
        raise ConfigError(f"{name} must be on or off, got {text!r}")
    return text.lower() == "on"


WEIGHTS = Kind(_read_weights, _write_weights)
ON_OFF = Kind(_read_on_off, lambda on: "on" if on else "off")


def _profile(name: str) -> str | None:
    return None if name in PROFILES else f"must be one of {', '.join(PROFILES)}, got {name!r}"


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterSettings(Settings):
    instance: str = common.instance("router-0")
    host: str = common.host()
    port: int = common.port(50071)
    listen: str = common.listen()
    http_listen: str = common.http_listen("the ingress's decision calls (Envoy's external processing) its "
                                          "sidecar forwards on the direct path")
    metrics_port: int = common.metrics_port()
    grace_seconds: float = common.grace_seconds()
    outbound: str = setting("GAAS_OUTBOUND", REQUIRED, "host:port (or unix:/path) of the sidecar's outbound "
                            "listener: control, kvcache and the workers are reached there")
    policy: str = setting("GAAS_ROUTER_POLICY", "kv_aware", "the scheduling profile: kv_aware (prefix, then load), "
                          "least_load, round_robin", check=_profile)
    weights: dict = setting("GAAS_ROUTER_WEIGHTS", None, "scorer weights overriding the profile's, e.g. "
                            "prefix=3,queue=2,kv_usage=0.5", kind=WEIGHTS, default_factory=dict)
    registry_refresh_seconds: float = setting("GAAS_REGISTRY_REFRESH_SECONDS", REGISTRY_REFRESH_SECONDS,
                                              "how often the view of the mesh (workers and their load) is read "
                                              "from control")
    retries: int = setting("GAAS_ROUTER_RETRIES", 2, "other workers tried when one fails before its first token")
    moves: int = setting("GAAS_ROUTER_STREAM_MOVES", 2, "times a stream whose worker fails after its first token "
                         "is carried on by another worker (0: the client gets the error)")
    qos: bool = setting("GAAS_QOS", True, "flow control by tier (bands, batching windows, the queue): on, or off "
                        "to compare", kind=ON_OFF)
    max_waiting: int = setting("GAAS_QUEUE_MAX", 256, "most requests waiting for a worker in this router")
    window_initial: int = setting("GAAS_WINDOW_INITIAL", 8, "each worker's batching window at start, requests")
    window_min: int = setting("GAAS_WINDOW_MIN", 4, "the smallest a batching window gets, requests")
    window_max: int = setting("GAAS_WINDOW_MAX", 64, "the largest a batching window gets, requests")
    breaker_cooldown_seconds: float = setting("GAAS_BREAKER_COOLDOWN_SECONDS", 5.0, "seconds a worker whose circuit "
                                              "breaker opened is left alone before a probe")
    deploy_file: str = setting("GAAS_DEPLOY_FILE", "", "the deployment file: the tiers' TTFT targets and queue "
                               "timeouts (qos:), sessions (sessions:); empty: the defaults")
    max_stream_seconds: float = setting("GAAS_MAX_STREAM_SECONDS", edge.MAX_STREAM_SECONDS, "longest a generation "
                                        "streams when its client set no deadline (gaas up gives every Envoy a "
                                        "stream idle timeout 30 s longer)")
    auth_cache_seconds: float = setting("GAAS_AUTH_CACHE_SECONDS", 2.0, "seconds an API key lookup is reused (a "
                                        "revoked key stops working within this)")
    max_stale_seconds: float = setting("GAAS_MAX_STALE_SECONDS", 60.0, "while control is unreachable: how long the "
                                       "last view of the mesh and the keys verified are used")
    max_body_bytes: int = setting("GAAS_MAX_BODY_BYTES", edge.MAX_BODY_BYTES, "largest OpenAI-API request body "
                                  "accepted, bytes (gaas up sizes the ingress's buffer to it)")
    batch_concurrency: int = setting("GAAS_BATCH_CONCURRENCY", 8, "batch items this router runs at once, in the "
                                     "band below bronze and only while no interactive request waits (0: none here)")
    coalesce_per_step: int = setting("GAAS_COALESCE_PER_STEP", 2, "fuller streamed messages as streams grow: "
                                     "streams in flight per token of a message (0: one token a message always)")
    coalesce_max: int = setting("GAAS_COALESCE_MAX", 8, "the most tokens a streamed message coalesces")
    redis_url: str = setting("GAAS_REDIS_URL", "redis://127.0.0.1:6379/0", "Redis, where usage events go and "
                             "budgets and sessions are kept")
    spool_dir: str = setting("GAAS_SPOOL_DIR", ".gaas/spool", "where usage events wait while Redis does not answer")


# The two edge limits an operator may change, as the router reads them: the launcher renders the
# ingress's Envoy config from the same values (gaas/envoy).

def max_body_bytes(env: Mapping[str, str] = os.environ) -> int:
    return value_from_env(RouterSettings, "max_body_bytes", env)


def max_stream_seconds(env: Mapping[str, str] = os.environ) -> float:
    return value_from_env(RouterSettings, "max_stream_seconds", env)


def stream_idle_timeout_s(env: Mapping[str, str] = os.environ) -> int:
    """How long a stream may move no byte, on every Envoy: longer than a generation may run, so a
    router or worker always ends a stream (with its own error) before an Envoy cuts it."""
    return int(max_stream_seconds(env)) + 30

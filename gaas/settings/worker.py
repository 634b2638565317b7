"""The worker's settings (services/worker), read once at start-up from GAAS_* variables: `gaas up`
writes them from the topology (services.worker in deploy/topology.yaml) and the deployment file's
model; the worker hands them to its vLLM engine (services/worker/vllm_engine.py maps them to vLLM's
engine arguments)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gaas.settings import common
from gaas.contracts.tasks import TASKS
from gaas.settings.env import BOOL, REQUIRED, Kind, Settings, setting, variables

# Where a worker's model runs, vLLM's names: "uni", in the engine core's own process; "mp", a
# process of its own (gaas.host.placement.engine_executor says what each means on each device).
EXECUTORS = ("uni", "mp")
# The adapter ranks vLLM 0.32 accepts as max_lora_rank.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# What the launcher found the host computes on (gaas.host.devices); "" when not launched by gaas up.
DEVICES = ("", "cpu", "cuda")


def _read_auto_bool(name: str, text: str) -> bool | None:
    return None if text == "auto" else BOOL.read(name, text)


# true, false, or auto (None): decided by the device.
AUTO_BOOL = Kind(_read_auto_bool, lambda v: "auto" if v is None else BOOL.write(v))


def _at_least_one_gib(gib: int) -> str | None:
    return None if gib >= 1 else "must be at least 1"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSettings(Settings):
    instance: str = common.instance("worker-0", "also its worker id in the registry")
    host: str = common.host()
    port: int = common.port(50061)
    listen: str = common.listen()
    metrics_port: int = setting("GAAS_METRICS_PORT", -1, "the /metrics port, with vLLM's own metrics (-1: none)")
    grace_seconds: float = common.grace_seconds()
    advertise: str = setting("GAAS_ADVERTISE", REQUIRED, "host:port peers reach it at: its sidecar's inbound "
                             "listener", derived=lambda s: f"{s['host']}:{s['port']}",
                             shown_default="GAAS_HOST:GAAS_PORT")
    http_listen: str = common.http_listen("the OpenAI generations its sidecar forwards on the direct path")
    outbound: str = setting("GAAS_OUTBOUND", "", "host:port (or unix:/path) of its sidecar's outbound listener "
                            "(control); empty: it runs standalone, unregistered")
    model: str = setting("GAAS_MODEL", REQUIRED, "the served model's name")
    model_path: str = setting("GAAS_MODEL_PATH", REQUIRED, "its weights: a directory or a hub id")
    model_version: str = setting("GAAS_MODEL_VERSION", "0", "its version")
    max_model_len: int = setting("GAAS_MAX_MODEL_LEN", 2048, "longest prompt and completion together, tokens")
    block_size: int = setting("GAAS_BLOCK_SIZE", 32, "KV block size, tokens",
                              check=lambda n: None if n % 16 == 0 else f"must be a multiple of 16 (32 on the CPU), got {n}")
    kv_cache_gib: int = setting("GAAS_KV_CACHE_GIB", 1, "KV cache, whole GiB (VLLM_CPU_KVCACHE_SPACE on the CPU, "
                                "kv_cache_memory_bytes on a GPU)", check=_at_least_one_gib)
    gpu_memory_utilization: float = setting(
        "GAAS_GPU_MEMORY_UTILIZATION", 0.85, "fraction of the GPU's memory vLLM may take (GPUs only; gaas up splits "
        "it between workers sharing a GPU)",
        check=lambda f: None if 0 < f <= 1 else f"must be in (0, 1], got {f}")
    enforce_eager: bool | None = setting("GAAS_ENFORCE_EAGER", None, "skip torch.compile and CUDA graphs (faster "
                                         "start, slower steps): true, false, or auto: on the CPU only", kind=AUTO_BOOL)
    device: str = setting("GAAS_DEVICE", "", "cpu or cuda, as gaas up found the host; the worker refuses a vLLM "
                          "build that computes elsewhere (empty: checks nothing)",
                          check=lambda d: None if d in DEVICES else f"must be cpu or cuda, got {d!r}")
    max_num_seqs: int = setting("GAAS_MAX_NUM_SEQS", 64, "most sequences batched together",
                                check=lambda n: None if n >= 1 else f"must be at least 1, got {n}")
    max_num_batched_tokens: int = setting("GAAS_MAX_NUM_BATCHED_TOKENS", 0, "most tokens in one engine step "
                                          "(0: vLLM's default)")
    handover_seconds: float = setting("GAAS_HANDOVER_SECONDS", 2.0, "a stopping worker lets its streams run this "
                                      "long, then hands the rest over: each is carried on at another worker from the "
                                      "tokens sent, by the router streaming it or by this worker's front end (-1: "
                                      "never; they finish here, within the grace)")
    retire_grace_seconds: float = setting("GAAS_RETIRE_GRACE_SECONDS", 600.0, "a worker its pool needs no more "
                                          "(SIGUSR1: gaas up, when a roll-out ends or a pool shrinks) takes no new "
                                          "request and lets the streams it has finish, this long at most (no "
                                          "hand-over: no other worker of its version may be left to carry them on)")
    max_waiting: int = setting("GAAS_MAX_WAITING", 128, "most requests waiting for their first token; more get "
                               "RESOURCE_EXHAUSTED, which the router takes elsewhere (0: no bound)")
    stream_interval: int = setting(
        "GAAS_STREAM_INTERVAL", 1, "tokens per streamed message (vLLM's stream_interval; the first token always goes "
        "at once)", check=lambda n: None if n >= 1 else f"must be at least 1 (tokens per message), got {n}")
    executor: str = setting("GAAS_EXECUTOR", "uni", "where the model runs: uni, in vLLM's engine core process; mp, "
                            "a process of its own (vLLM's CPU default)",
                            check=lambda e: None if e in EXECUTORS else f"must be one of {', '.join(EXECUTORS)}, got {e!r}")
    kv_cache_blocks: int = setting("GAAS_KV_CACHE_BLOCKS", 0, "KV-cache size in blocks (vLLM's "
                                   "num_gpu_blocks_override; 0: sized by memory)")
    max_loras: int = setting("GAAS_MAX_LORAS", 0, "LoRA adapters one engine step may serve at once (vLLM's "
                             "max_loras); 0: the engine serves no adapters (`gaas lora add` refuses its model's)",
                             check=lambda n: None if n >= 0 else f"must be 0 or more, got {n}")
    max_lora_rank: int = setting("GAAS_MAX_LORA_RANK", 16, "the highest adapter rank served (vLLM's max_lora_rank: "
                                 "8, 16, 32, 64, 128 or 256)",
                                 check=lambda n: None if n in LORA_RANKS else f"must be one of "
                                 f"{', '.join(map(str, LORA_RANKS))}, got {n}")
    max_cpu_loras: int = setting("GAAS_MAX_CPU_LORAS", 0, "adapters kept loaded (vLLM's max_cpu_loras; the least "
                                 "recently used goes when another loads); 0: max_loras",
                                 check=lambda n: None if n >= 0 else f"must be 0 or more, got {n}")
    tool_parser: str = setting("GAAS_TOOL_PARSER", "", "the vLLM tool parser that reads tool calls out of this "
                               "model's output for tool_choice \"auto\" (hermes, llama3_json, mistral, ...: the "
                               "model's chat template decides); empty: \"auto\" with tools is refused (named and "
                               "\"required\" choices need none)",
                               check=lambda n: None if n == "" or n.replace("_", "").replace("-", "").isalnum()
                               else f"must be a tool parser's name (hermes, llama3_json, ...), got {n!r}")
    task: str = setting("GAAS_TASK", "generate", "what the model serves: generate (completions and chats) or embed "
                        "(a vector per input, /v1/embeddings: vLLM's pooling runner, a generative model converted "
                        "as vLLM converts it)",
                        check=lambda t: None if t in TASKS else f"must be one of {', '.join(TASKS)}, got {t!r}")
    kv_events: bool = setting("GAAS_KV_EVENTS", True, "publish the engine's KV events to the KV directories")
    warmup_requests: int = setting("GAAS_WARMUP_REQUESTS", 2, "requests a worker runs through its engine once "
                                   "loaded, before it registers and takes traffic (0: none)",
                                   check=lambda n: None if n >= 0 else f"must be 0 or more, got {n}")
    lease_renew_seconds: float = setting("GAAS_LEASE_RENEW_SECONDS", 0.5, "how often its lease is renewed, each "
                                         "renewal with a load report (control decides how long a lease lasts)")
    redis_url: str = setting("GAAS_REDIS_URL", "", "Redis, where the usage of generations the ingress sends here "
                             "straight goes (ingress.path: direct); empty: not metered here")
    spool_dir: str = setting("GAAS_SPOOL_DIR", ".gaas/spool", "where those usage events wait while Redis does not "
                             "answer")


# The worker settings a topology sets for every worker (services.worker in deploy/topology.yaml),
# and a deployment pool for its own (a model's engine: in deploy/gaas.yaml), by the same names.
TOPOLOGY_OPTIONS = ("kv_cache_gib", "kv_cache_blocks", "block_size", "enforce_eager", "max_num_seqs",
                    "max_num_batched_tokens", "max_waiting", "stream_interval", "executor")
# The settings only a pool sets (the control plane checks adapters against its model's): LoRA,
# the tool parser its model's chat template calls for, and what the model serves.
POOL_OPTIONS = ("max_loras", "max_lora_rank", "max_cpu_loras", "tool_parser", "task")
ENGINE_OPTIONS = TOPOLOGY_OPTIONS + POOL_OPTIONS


def topology_defaults() -> dict[str, Any]:
    """The defaults of a topology's worker options, as the topology writes them (enforce_eager:
    true, false or "auto")."""
    defaults = {v.field: v.default for v in variables(WorkerSettings) if v.field in TOPOLOGY_OPTIONS}
    if defaults["enforce_eager"] is None:
        defaults["enforce_eager"] = "auto"
    return {f: defaults[f] for f in TOPOLOGY_OPTIONS}


def lora_limits(engine: Mapping[str, Any]) -> tuple[int, int]:
    """(max_loras, max_lora_rank) of a pool's engine settings (max_loras 0: no adapters)."""
    defaults = {v.field: v.default for v in variables(WorkerSettings) if v.field in POOL_OPTIONS}
    return int(engine.get("max_loras", defaults["max_loras"])), int(engine.get("max_lora_rank", defaults["max_lora_rank"]))


def engine_options(values: Mapping[str, Any], known: tuple[str, ...] = TOPOLOGY_OPTIONS) -> dict[str, Any]:
    """Engine settings as a file writes them (the topology's services.worker: known, a deployment
    pool's engine: ENGINE_OPTIONS) checked as the worker would check them; ValueError naming the
    one that is wrong. enforce_eager keeps "auto"."""
    by_field = {v.field: v for v in variables(WorkerSettings) if v.field in known}
    out: dict[str, Any] = {}
    for key, value in values.items():
        v = by_field.get(key)
        if v is None:
            extra = " (LoRA is set per model, in deploy/gaas.yaml's engine:)" if key in POOL_OPTIONS else ""
            raise ValueError(f"unknown engine setting {key!r}{extra}; known: {', '.join(known)}")
        if key == "enforce_eager" and value == "auto":
            out[key] = value
            continue
        if isinstance(value, (dict, list)) or value is None or (isinstance(value, bool) and v.kind is not BOOL
                                                                 and v.kind is not AUTO_BOOL):
            raise ValueError(f"{key} must be a {'true/false' if v.kind in (BOOL, AUTO_BOOL) else 'single value'}, "
                             f"got {value!r}")
        text = BOOL.write(value) if isinstance(value, bool) else str(value)
        try:
            parsed = v.kind.read(key, text)
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        if v.var.check is not None and (wrong := v.var.check(parsed)) is not None:
            raise ValueError(f"{key} {wrong}")
        out[key] = "auto" if key == "enforce_eager" and parsed is None else parsed
    return out


def from_topology(options: Mapping[str, Any]) -> dict[str, Any]:
    """A worker instance's engine options (gaas.ops.topology.Instance.options: the topology's, and
    its pool's over them) as WorkerSettings fields."""
    values = {f: options[f] for f in TOPOLOGY_OPTIONS}
    values.update({f: options[f] for f in POOL_OPTIONS if f in options})
    if values["enforce_eager"] == "auto":
        values["enforce_eager"] = None
    return values


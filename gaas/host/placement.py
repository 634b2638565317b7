"""Placement, in one place for the launcher (gaas/launcher/mesh.py), the worker (services/worker/vllm_engine.py)
and the benchmarks. On a CPU host: which core each worker's engine computes on, where the rest of
its processes go, and moving processes there (Linux). On a GPU host: which GPU each worker gets and
what share of its memory.
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from gaas.settings.env import default_of
from gaas.settings.worker import EXECUTORS, WorkerSettings

# The share of a GPU's memory vLLM may take (the worker setting's default), split between the
# workers that share the GPU.
GPU_MEMORY_BUDGET = default_of(WorkerSettings, "gpu_memory_utilization")


class PlacementError(ValueError):
    """The workers do not fit the devices; the message says what to change."""


@dataclass(frozen=True, slots=True)
class GpuSlot:
    # The GPU's UUID (GPU-... or MIG-...): the worker's CUDA_VISIBLE_DEVICES.
    uuid: str
    # How many workers share this GPU (1: it has it alone).
    shared_by: int
    # vLLM's gpu_memory_utilization for this worker: its share of the budget.
    memory_fraction: float


def worker_gpus(gpus, workers: int, *, budget: float = GPU_MEMORY_BUDGET, kv_cache_bytes: int = 0,
                fits: Sequence[Collection[str] | None] = ()) -> list[GpuSlot]:
    """One slot per worker, in worker order: each on the GPU with the fewest workers so far among
    those its pool fits (fits[i]: the UUIDs worker i's pool may run on; None or missing: any), the
    first such on a tie, so workers whose pools fit every GPU go round them in turn (worker i on
    GPU i mod len(gpus)). Workers that share a GPU split its memory budget, so that none asks vLLM
    for memory another holds; PlacementError when a share cannot hold the KV cache a worker is
    given, or a pool fits none of these GPUs."""
    if not gpus:
        raise PlacementError("no GPU to place workers on")
    if not 0 < budget <= 1:
        raise PlacementError(f"the GPU memory budget must be in (0, 1], got {budget}")
    on, count = [], {g.uuid: 0 for g in gpus}
    for i in range(workers):
        allowed = fits[i] if i < len(fits) else None
        candidates = [g for g in gpus if allowed is None or g.uuid in allowed]
        if not candidates:
            raise PlacementError(f"worker {i}'s pool fits none of this host's GPUs ({', '.join(count)})")
        gpu = min(candidates, key=lambda g: count[g.uuid])  # (min keeps the first of equals)
        count[gpu.uuid] += 1
        on.append(gpu)
    slots = []
    for gpu in on:
        shared_by = sum(1 for g in on if g.uuid == gpu.uuid)
        fraction = math.floor(budget / shared_by * 10_000) / 10_000  # never above the budget
        if kv_cache_bytes and kv_cache_bytes >= fraction * gpu.memory_total:
            raise PlacementError(
                f"{shared_by} workers share {gpu.name} {gpu.uuid} ({gpu.memory_total / 2**30:.0f} GiB): each may use "
                f"{fraction:.2f} of it ({fraction * gpu.memory_total / 2**30:.1f} GiB), less than the KV cache each is "
                f"given ({kv_cache_bytes / 2**30:.1f} GiB) before the model's weights: run fewer workers (--workers; "
                "one per GPU by default) or give each a smaller kv_cache_gib"
            )
        slots.append(GpuSlot(gpu.uuid, shared_by, fraction))
    return slots


def set_process_affinity(pid: int, cpus: set[int]) -> int:
    """Set the CPU affinity of every thread of process pid (sched_setaffinity is per thread);
    returns how many threads were moved."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0  # gone
    moved = 0
    for task in tasks:
        try:
            os.sched_setaffinity(int(task), cpus)
            moved += 1
        except OSError:
            pass  # a thread that just ended
    return moved


def worker_cpus(index: int, workers: int) -> tuple[int, set[int] | None]:
    """(core the worker's engine computes on, CPUs for the rest of its processes; None: any).

    The engine's model runner is pinned to one core (one worker per core). Its front end (gRPC,
    tokenizing, streaming) keeps to the cores no engine computes on, when there are any: sharing
    its engine's core delays every streamed token by tens of milliseconds. With an engine on every
    core it is left unpinned: pinned to another worker's engine core, a process was measured
    getting no CPU at all for minutes (Linux 6.18 never picked it while the runner was busy) -- a
    restarted worker that never started, a killed one that took minutes to be reaped.
    """
    cores = sorted(os.sched_getaffinity(0))
    core = cores[index % len(cores)]
    engines = {cores[i % len(cores)] for i in range(max(workers, index + 1))}
    free = set(cores) - engines
    return core, free or None


def parse_cpu_list(spec: str) -> set[int]:
    """'0', '0-3' or '0,2,4-5' -> CPU numbers; empty for anything else ('auto', 'nobind')."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return set()
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_descendants(root: int, cpus: set[int]) -> int:
    """Set the CPU affinity of every thread of every process below root; returns threads moved."""
    return sum(set_process_affinity(child, cpus) for child in descendants(root))


def descendants(pid: int) -> list[int]:
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
            out.extend(descendants(c))
    return out


# Where a worker's model runs, vLLM's names (EXECUTORS, a worker setting): "uni", in the engine
# core's own process (one Python process less per worker, ~400 MB, and no hand-off between
# processes at every engine step); "mp", a process of its own (what vLLM's CPU platform otherwise
# insists on).
# vLLM's in-process executor named by its class: vLLM's CPU platform turns the name "uni" into "mp"
# ("OMP requires the MP executor"), because an engine core would start one OpenMP thread per core
# of the host; engine_executor gives it one per core it computes on instead.
IN_PROCESS_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


def engine_executor(executor: str, on_gpu: bool, bind: str = "") -> tuple[str | None, dict[str, str]]:
    """(vLLM's distributed_executor_backend for a one-device worker, None for vLLM's own choice;
    what the engine's environment needs for it).

    On a GPU vLLM already runs a single device's model in process. On the CPU in process the
    engine core's OpenMP threads compute, so exactly one per core of bind (vLLM's
    VLLM_CPU_OMP_THREADS_BIND): with more threads than cores they take turns at every parallel
    region (measured: 100 ms to the first token instead of 4). With bind "auto" vLLM picks the
    cores itself, too late for that, so the model runner keeps a process of its own."""
    if executor not in EXECUTORS:
        raise PlacementError(f"the executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    if executor == "mp":
        return "mp", {}
    if on_gpu:
        return None, {}
    cpus = parse_cpu_list(bind)
    if not cpus:
        return "mp", {}
    return IN_PROCESS_EXECUTOR, {"OMP_NUM_THREADS": str(len(cpus))}


def cpu_engine_environment(executor: str, kv_cache_gib: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What a CPU engine's processes need in their environment from their start: the cache's size
    (vLLM otherwise reserves most of the RAM for it), one OpenMP thread per core of the worker's
    bind (engine_executor), and the libraries vLLM's CPU platform preloads for its engine
    process (torch's libgomp unless an OpenMP is preloaded already, its bundled tcmalloc), as its
    check_and_update_config sets LD_PRELOAD before spawning one. environ: the worker's environment
    (its VLLM_CPU_OMP_THREADS_BIND and LD_PRELOAD).

    `gaas up` starts a CPU worker with these already (gaas.launcher.workerenv), so that the
    engine's server can be forked from the worker itself (services/worker/enginefork.py)."""
    _, env = engine_executor(executor, False, environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"))
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    preload = environ.get("LD_PRELOAD", "")
    torch_dir, vllm_dir = _package_dir("torch"), _package_dir("vllm")
    if torch_dir and not any(lib in preload for lib in ("libomp", "libgomp", "libiomp")):
        site = os.path.dirname(torch_dir)
        found = glob.glob(os.path.join(site, "torch.libs", "libgomp*.so*")) + glob.glob(
            os.path.join(torch_dir, "lib", "libgomp*.so*"))
        if found:
            preload = f"{preload}:{found[0]}" if preload else found[0]
    if vllm_dir and "libtcmalloc" not in preload:
        found = glob.glob(os.path.join(vllm_dir, "libs", "libtcmalloc_minimal*.so*")) or glob.glob(
            os.path.join(vllm_dir, "libs", "libtcmalloc.so*"))
        if found:
            preload = f"{found[0]}:{preload}" if preload else found[0]
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    return list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None

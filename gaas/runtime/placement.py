"""CPU placement on a CPU host, in one place for the launcher (gaas/mesh.py), the worker
(services/worker/engine.py) and the benchmarks: which core each worker's engine computes on, where
the rest of its processes go, and moving processes there (Linux)."""

from __future__ import annotations

import os


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

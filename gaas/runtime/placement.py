"""CPU placement helpers shared by the launcher and the services (Linux)."""

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

"""What a process tree costs, from Linux's /proc: resident memory (RSS, and PSS, which splits the
pages processes share among them, so a tree's PSS adds up honestly) and CPU time. The serving
benchmark reads each mesh process with these: memory after the load, CPU across a run."""

from __future__ import annotations

import os

from gaas.runtime.placement import descendants

_TICK = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    return [pid, *descendants(pid)]


def memory(pid: int) -> dict:
    """RSS and PSS of pid and its descendants, in MB (10^6 bytes), and how many processes."""
    rss = pss = 0
    pids = tree(pid)
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key == "Rss":
                        rss += int(rest.split()[0]) * 1024
                    elif key == "Pss":
                        pss += int(rest.split()[0]) * 1024
        except (OSError, ValueError):
            continue
    return {"rss_mb": round(rss / 1e6, 1), "pss_mb": round(pss / 1e6, 1), "processes": len(pids)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of pid and its descendants so far."""
    total = 0
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
        except (OSError, ValueError, IndexError):
            continue
    return total / _TICK
